//! Who may read or write a note, as stored: the grants in force, and the configuration's grants
//! as they were last applied (so a start can tell a change of the configuration from a change
//! made at run time).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use spacebot_core::AgentId;

use crate::model::Access;

/// The stored access of one note (namespace `notes.access`, key: the note's name).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct AccessRecord {
    /// The grants in force.
    #[serde(default)]
    pub grants: BTreeMap<AgentId, Access>,
    /// The configuration's grants for this note as last applied at a start.
    #[serde(default)]
    pub config: BTreeMap<AgentId, Access>,
}

/// What a start did to one note's grants (see [`reconcile`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct Reconciled {
    /// Grants the configuration changed since the last start, applied (`None`: removed).
    pub applied: BTreeMap<AgentId, Option<Access>>,
    /// Grants that differ from the configuration because they were changed at run time (by
    /// `grant` or `revoke`) and the configuration did not change for that agent since: kept
    /// (`None`: revoked at run time).
    pub kept: BTreeMap<AgentId, Option<Access>>,
}

impl Reconciled {
    /// Whether there is anything to report.
    pub fn is_empty(&self) -> bool {
        self.applied.is_empty() && self.kept.is_empty()
    }
}

/// Merges the configuration's grants for one note into the stored ones, as at a start.
///
/// For each agent: if the configuration says something else than it said when last applied
/// (`stored.config`), **the configuration wins** (its grant, or no grant, is applied); otherwise the
/// stored grant stays, so a grant or a revocation made at run time survives a restart. The
/// returned record's `config` is `config`.
///
/// ```
/// use std::collections::BTreeMap;
/// use spacebot_core::AgentId;
/// use spacebot_notes::{reconcile, Access, AccessRecord};
/// let a = AgentId::parse("a").unwrap();
/// let b = AgentId::parse("b").unwrap();
/// // Last start: the config let a read. Since then, a was revoked and b granted at run time.
/// let stored = AccessRecord {
///     grants: BTreeMap::from([(b.clone(), Access::Read)]),
///     config: BTreeMap::from([(a.clone(), Access::Read)]),
/// };
/// // The config did not change: the run-time changes are kept.
/// let (same, report) = reconcile(&stored, &stored.config.clone());
/// assert_eq!(same.grants, stored.grants);
/// assert_eq!(report.kept.get(&a), Some(&None));
/// // The config now lets a write: that change wins.
/// let (next, report) = reconcile(&stored, &BTreeMap::from([(a.clone(), Access::ReadWrite)]));
/// assert_eq!(next.grants.get(&a), Some(&Access::ReadWrite));
/// assert_eq!(next.grants.get(&b), Some(&Access::Read));
/// assert_eq!(report.applied.get(&a), Some(&Some(Access::ReadWrite)));
/// ```
pub fn reconcile(
    stored: &AccessRecord,
    config: &BTreeMap<AgentId, Access>,
) -> (AccessRecord, Reconciled) {
    let mut grants = stored.grants.clone();
    let mut report = Reconciled::default();
    let agents: std::collections::BTreeSet<&AgentId> = config
        .keys()
        .chain(stored.config.keys())
        .chain(stored.grants.keys())
        .collect();
    for agent in agents {
        let now = config.get(agent).copied();
        let before = stored.config.get(agent).copied();
        if now != before {
            match now {
                Some(access) => grants.insert(agent.clone(), access),
                None => grants.remove(agent),
            };
            report.applied.insert(agent.clone(), now);
        } else if stored.grants.get(agent).copied() != now {
            report
                .kept
                .insert(agent.clone(), stored.grants.get(agent).copied());
        }
    }
    (
        AccessRecord {
            grants,
            config: config.clone(),
        },
        report,
    )
}
