//! The `[[agents]]` fields this crate claims: `a2a_expose` (serve the agent over A2A), and
//! `a2a` + `token` (the agent is a remote A2A agent).

use std::collections::{BTreeMap, BTreeSet};

use spacebot_core::AgentId;
use spacebot_core::config::{ConfigError, ConfigIssue, OrgConfig};

/// `a2a_expose = true`: the agent is served over A2A.
pub const EXPOSE_FIELD: &str = "a2a_expose";
/// `a2a = "http://..."`: the agent is a remote A2A agent at that base URL (its card is at
/// `{url}/.well-known/agent-card.json`).
pub const URL_FIELD: &str = "a2a";
/// `token = "..."`: the bearer token sent to a remote A2A agent.
pub const TOKEN_FIELD: &str = "token";

/// A remote A2A agent, a member of the organization.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RemoteAgent {
    /// Its id in the organization.
    pub id: AgentId,
    /// Its base URL.
    pub url: String,
    /// The bearer token sent with every request.
    pub token: Option<String>,
}

/// What the configuration says about A2A.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct A2aConfig {
    /// The agents served over A2A.
    pub exposed: BTreeSet<AgentId>,
    /// The remote agents, by id.
    pub remote: BTreeMap<AgentId, RemoteAgent>,
}

fn issue(entry: &str, field: &str, problem: &str) -> ConfigIssue {
    ConfigIssue {
        entry: entry.to_owned(),
        field: Some(field.to_owned()),
        problem: problem.to_owned(),
    }
}

impl A2aConfig {
    /// Reads the A2A fields of every `[[agents]]` entry.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming every entry and field at fault: an `a2a_expose` that is not
    /// a boolean, an `a2a` that is not an `http://` or `https://` URL, a `token` that is not a
    /// non-empty string of visible ASCII or that comes without `a2a`, a remote agent exposed.
    pub fn from_org(config: &OrgConfig) -> Result<Self, ConfigError> {
        let mut issues = Vec::new();
        let mut out = Self::default();
        for (i, agent) in config.agents.iter().enumerate() {
            let entry = format!("agents[{i}] ({})", agent.id);
            let exposed = match agent.fields.get(EXPOSE_FIELD) {
                None | Some(toml::Value::Boolean(false)) => false,
                Some(toml::Value::Boolean(true)) => true,
                Some(_) => {
                    issues.push(issue(&entry, EXPOSE_FIELD, "expected true or false"));
                    false
                }
            };
            let url = match agent.fields.get(URL_FIELD) {
                None => None,
                Some(toml::Value::String(url))
                    if (url.starts_with("http://") || url.starts_with("https://"))
                        && url.len() > "https://".len() =>
                {
                    Some(url.trim_end_matches('/').to_owned())
                }
                Some(_) => {
                    issues.push(issue(
                        &entry,
                        URL_FIELD,
                        "expected the remote agent's base URL, http://... or https://...",
                    ));
                    None
                }
            };
            let token = match agent.fields.get(TOKEN_FIELD) {
                None => None,
                Some(toml::Value::String(t))
                    if !t.is_empty() && t.chars().all(|c| c.is_ascii_graphic()) =>
                {
                    Some(t.clone())
                }
                Some(_) => {
                    issues.push(issue(
                        &entry,
                        TOKEN_FIELD,
                        "expected a non-empty string of visible ASCII characters",
                    ));
                    None
                }
            };
            if token.is_some() && !agent.fields.contains_key(URL_FIELD) {
                issues.push(issue(
                    &entry,
                    TOKEN_FIELD,
                    "a token is for a remote A2A agent: give its URL in `a2a` too",
                ));
            }
            if exposed && agent.fields.contains_key(URL_FIELD) {
                issues.push(issue(
                    &entry,
                    EXPOSE_FIELD,
                    "a remote A2A agent cannot be exposed over A2A again",
                ));
            } else if exposed {
                out.exposed.insert(agent.id.clone());
            }
            if let Some(url) = url {
                out.remote.insert(
                    agent.id.clone(),
                    RemoteAgent {
                        id: agent.id.clone(),
                        url,
                        token,
                    },
                );
            }
        }
        if issues.is_empty() {
            Ok(out)
        } else {
            Err(ConfigError::Invalid { path: None, issues })
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_read_and_mistakes_named() {
        let config = OrgConfig::from_toml_str(
            r#"
            [[agents]]
            id = "front"
            a2a_expose = true
            [[agents]]
            id = "far"
            a2a = "http://127.0.0.1:9/"
            token = "t0k"
            "#,
        )
        .unwrap();
        let a2a = A2aConfig::from_org(&config).unwrap();
        assert_eq!(a2a.exposed.len(), 1);
        let far = &a2a.remote[&AgentId::parse("far").unwrap()];
        assert_eq!(far.url, "http://127.0.0.1:9");
        assert_eq!(far.token.as_deref(), Some("t0k"));

        let bad = OrgConfig::from_toml_str(
            r#"
            [[agents]]
            id = "a"
            a2a_expose = "yes"
            [[agents]]
            id = "b"
            a2a = "ftp://x"
            [[agents]]
            id = "c"
            token = "t"
            "#,
        )
        .unwrap();
        let err = A2aConfig::from_org(&bad).unwrap_err().to_string();
        assert!(err.contains("agents[0] (a): field \"a2a_expose\""), "{err}");
        assert!(err.contains("agents[1] (b): field \"a2a\""), "{err}");
        assert!(err.contains("agents[2] (c): field \"token\""), "{err}");
    }
}
