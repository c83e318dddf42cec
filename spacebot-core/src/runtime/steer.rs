//! The steer-backlog merge as pure functions.
//!
//! At a checkpoint (after a tool round, before the next model call) the agent's loop drains its
//! queue. [`split_backlog`] separates what only belongs in the history (sent and system records)
//! from what must be answered; [`merge_backlog`] turns the latter into the one user message the model
//! answers next. The interrupted message goes back to the front of the queue.

use crate::envelope::{Envelope, Source};

/// What a drained backlog holds.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Backlog {
    /// Envelopes the model must answer, in arrival order.
    pub to_answer: Vec<Envelope>,
    /// History-only records (sent and system records), in arrival order.
    pub records: Vec<Envelope>,
}

/// Splits drained envelopes into those to answer and history-only records, keeping arrival order
/// within each.
pub fn split_backlog(drained: Vec<Envelope>) -> Backlog {
    let mut backlog = Backlog::default();
    for envelope in drained {
        if envelope.kind.wakes_model() {
            backlog.to_answer.push(envelope);
        } else {
            backlog.records.push(envelope);
        }
    }
    backlog
}

/// A short label of who sent an envelope, for the model: `user (portal)`, `agent tech-lead`, `system`.
pub fn source_label(source: &Source) -> String {
    match source {
        Source::External { platform, .. } => format!("user ({platform})"),
        Source::Internal { from_agent, .. } => format!("agent {from_agent}"),
        Source::System => "system".to_string(),
    }
}

/// The one user message the model answers for `envelopes` (in order).
///
/// A single envelope is passed through as it is; several become a numbered list with their senders,
/// so the model answers all of them in one reply.
///
/// ```
/// use spacebot_core::runtime::steer::merge_backlog;
/// use spacebot_core::{AgentId, ChannelId, Envelope, EnvelopeKind, Source, Timestamp};
/// let a = AgentId::parse("a").unwrap();
/// let user = Source::External { platform: "portal".into(), reply_target: "u1".into() };
/// let env = |t: &str| Envelope::new(user.clone(), ChannelId::portal(&a), EnvelopeKind::UserMessage, t, Timestamp(0));
/// assert_eq!(merge_backlog(&[env("stop")]), "stop");
/// let merged = merge_backlog(&[env("stop"), env("use French")]);
/// assert!(merged.contains("[1] user (portal): stop") && merged.contains("[2] user (portal): use French"));
/// ```
pub fn merge_backlog(envelopes: &[Envelope]) -> String {
    match envelopes {
        [] => String::new(),
        [one] => one.content.clone(),
        many => {
            let mut out = format!(
                "{} messages arrived while you were working. Answer them together, in one reply:\n",
                many.len()
            );
            for (i, e) in many.iter().enumerate() {
                out.push_str(&format!(
                    "\n[{}] {}: {}",
                    i + 1,
                    source_label(&e.source),
                    e.content
                ));
            }
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::EnvelopeKind;
    use crate::ids::{AgentId, ChannelId};
    use crate::time::Timestamp;

    fn env(kind: EnvelopeKind, text: &str) -> Envelope {
        let a = AgentId::parse("a").unwrap();
        Envelope::new(
            Source::System,
            ChannelId::portal(&a),
            kind,
            text,
            Timestamp(0),
        )
    }

    #[test]
    fn split_keeps_order_and_separates_records() {
        let drained = vec![
            env(EnvelopeKind::UserMessage, "1"),
            env(EnvelopeKind::SystemRecord, "r1"),
            env(EnvelopeKind::Announce, "2"),
            env(EnvelopeKind::SentRecord, "r2"),
            env(EnvelopeKind::Retrigger, "3"),
        ];
        let b = split_backlog(drained);
        let a: Vec<_> = b.to_answer.iter().map(|e| e.content.as_str()).collect();
        let r: Vec<_> = b.records.iter().map(|e| e.content.as_str()).collect();
        assert_eq!(a, ["1", "2", "3"]);
        assert_eq!(r, ["r1", "r2"]);
    }

    #[test]
    fn merge_numbers_every_message_in_order() {
        let merged = merge_backlog(&[
            env(EnvelopeKind::UserMessage, "first"),
            env(EnvelopeKind::UserMessage, "second"),
            env(EnvelopeKind::UserMessage, "third"),
        ]);
        let p1 = merged.find("[1] system: first").unwrap();
        let p2 = merged.find("[2] system: second").unwrap();
        let p3 = merged.find("[3] system: third").unwrap();
        assert!(p1 < p2 && p2 < p3);
        assert!(merged.starts_with("3 messages arrived"));
        assert_eq!(merge_backlog(&[]), "");
    }
}
