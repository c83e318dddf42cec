//! Envelopes stored by the release before claimed work had owners (commit 9f43d1e: `task` without
//! `owner`) still load, as delegation's work with the same effect keys, and are written back in the
//! same shape plus the owner.

use spacebot_core::{Envelope, EnvelopeKind};

const FIXTURE: &str = include_str!("fixtures/envelopes-9f43d1e.jsonl");

fn stored() -> Result<Vec<(serde_json::Value, Envelope)>, serde_json::Error> {
    FIXTURE
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| Ok((serde_json::from_str(line)?, serde_json::from_str(line)?)))
        .collect()
}

#[test]
fn envelopes_of_the_previous_release_load() {
    let envelopes = stored().unwrap();
    assert_eq!(envelopes.len(), 3);
    let kinds: Vec<EnvelopeKind> = envelopes.iter().map(|(_, e)| e.kind).collect();
    assert_eq!(
        kinds,
        [
            EnvelopeKind::UserMessage,
            EnvelopeKind::TaskAssigned,
            EnvelopeKind::Retrigger
        ]
    );
    let work = envelopes[1].1.task.as_ref().expect("the claimed task");
    assert_eq!(
        work.owner, "delegation",
        "work stored without an owner is delegation's"
    );
    assert_eq!((work.number, work.generation), (1, 2));
    assert_eq!(work.holder, "spacebot-tech-lead:worker:a1b2c3");
    // A turn run again after the upgrade asks for its effects under the keys it used before.
    let delegation = spacebot_core::delegation::Delegation::default();
    assert_eq!(
        spacebot_core::Behaviour::work_key(&delegation, work),
        "task1g2"
    );
    assert_eq!(envelopes[1].1.round, 1);
    assert_eq!(
        envelopes[2].1.conversation.as_ref().map(|c| c.to_string()),
        Some("c-42".to_string())
    );
    assert_eq!(envelopes[0].1.cause(), &envelopes[0].1.id);
}

#[test]
fn a_stored_envelope_is_written_back_in_its_own_shape_plus_the_owner() {
    for (raw, envelope) in stored().unwrap() {
        let mut written = serde_json::to_value(&envelope).unwrap();
        if let Some(task) = written.get_mut("task").and_then(|t| t.as_object_mut()) {
            assert_eq!(task.remove("owner"), Some(serde_json::json!("delegation")));
        }
        assert_eq!(
            written, raw,
            "no field renamed, added or dropped but the owner"
        );
    }
}
