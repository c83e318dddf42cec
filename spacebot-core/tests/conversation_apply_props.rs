//! Property tests of the conversation lifecycle as a pure function (`Conversation::apply`): random
//! event sequences against an independent table, with reopenings, result retriggers, steered turns
//! and restarts (the record reloaded from its serialized form) interleaved. Whatever the order, the
//! turns taken never exceed the budget, a spent budget stays spent, a severed conversation stays
//! severed, and effects come only from accepted transitions.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // test code: failing loudly is the point

use proptest::prelude::*;
use spacebot_core::conversation::{
    Conversation, ConversationMode, ConversationStatus, Member, MemberRole,
};
use spacebot_core::dialogue::{ConversationEvent, ConversationEventKind, Effect, TransitionError};
use spacebot_core::{AgentId, ChannelId, ConversationId, Timestamp};

fn id(s: &str) -> AgentId {
    AgentId::parse(s).unwrap()
}

const AGENTS: [&str; 4] = ["a", "b", "c", "d"];

/// A new open conversation of `size` members (`a` the initiator) with `budget` turns.
fn conversation(mode: ConversationMode, size: usize, budget: u32, origin: bool) -> Conversation {
    let cid = ConversationId::new("c1");
    let size = if mode == ConversationMode::Mirrored {
        2
    } else {
        size
    };
    let members = AGENTS[..size]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let agent = id(name);
            let channel = match mode {
                ConversationMode::Mirrored => ChannelId::link(&agent, &id(AGENTS[1 - i])),
                ConversationMode::Group => ChannelId::new(format!("conversation:{cid}")),
            };
            Member {
                agent,
                channel,
                name: name.to_uppercase(),
                number: u32::try_from(i + 1).unwrap(),
                role: match (i, mode) {
                    (0, _) => MemberRole::Initiator,
                    (_, ConversationMode::Mirrored) => MemberRole::Responder,
                    _ => MemberRole::Member,
                },
                open: true,
            }
        })
        .collect();
    Conversation {
        id: cid,
        mode,
        members,
        initiator: id("a"),
        initiated_from: origin.then(|| ChannelId::new("portal:chat:a")),
        status: ConversationStatus::Open,
        budget_remaining: budget,
        pair_key: Some("k".into()),
        summary: None,
        revision: 1,
        created_at: Timestamp(0),
        updated_at: Timestamp(0),
    }
}

/// What happens next, as the service and the runtime would make it happen.
#[derive(Debug, Clone)]
enum Op {
    /// A member (or an outsider, index 4) reopens the conversation.
    Reopen { by: usize, origin: bool },
    /// A member's answer crosses (a send by tool with a sent record, or a final answer).
    Turn { by: usize, sent_record: bool },
    /// A member's turn is steered: it answers the steering message, then resumes and answers again.
    Steer { by: usize },
    /// The initiator is woken with the result of a conclusion and opens the conversation again
    /// under the same request: a reopening and a send.
    Retrigger,
    /// A member concludes; `replay` says the call ran before (a turn run again after a crash).
    Conclude { by: usize, replay: bool },
    /// A member (or the application) severs.
    Sever { by: Option<usize> },
    /// The process restarts: the record is reloaded from its serialized form.
    Restart,
    /// The process dies between a turn that spent the budget and its sever (the sever that follows
    /// a spent budget is skipped once).
    CrashBeforeSever,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0usize..5, any::<bool>()).prop_map(|(by, origin)| Op::Reopen { by, origin }),
        6 => (0usize..5, any::<bool>()).prop_map(|(by, sent_record)| Op::Turn { by, sent_record }),
        2 => (0usize..4).prop_map(|by| Op::Steer { by }),
        2 => Just(Op::Retrigger),
        2 => (0usize..5, any::<bool>()).prop_map(|(by, replay)| Op::Conclude { by, replay }),
        1 => prop::option::of(0usize..4).prop_map(|by| Op::Sever { by }),
        2 => Just(Op::Restart),
        1 => Just(Op::CrashBeforeSever),
    ]
}

fn agent(i: usize) -> AgentId {
    id(["a", "b", "c", "d", "z"][i.min(4)])
}

/// The lifecycle table, written out independently of `apply`: the status after `kind` by a member
/// (or not) from `status` with `budget` turns left, and whether the record changes. `None`: refused.
fn allowed(
    status: ConversationStatus,
    kind: ConversationEventKind,
    member: bool,
    budget: u32,
    replay: bool,
) -> Option<(ConversationStatus, bool)> {
    use ConversationEventKind as E;
    use ConversationStatus as S;
    Some(match (status, kind) {
        (S::Severed, E::Sever) => (S::Severed, false),
        (S::Open | S::Concluded, E::Sever) => (S::Severed, true),
        _ if !member => return None,
        (S::Concluded, E::Reopen) => (S::Open, true),
        (S::Open, E::TakeTurn) if budget > 0 => (S::Open, true),
        (S::Open, E::Conclude) => (S::Concluded, true),
        (S::Concluded, E::Conclude) if replay => (S::Concluded, false),
        _ => return None,
    })
}

/// Applies events, checking each against the table, and counts what crossed.
struct Run {
    conversation: Conversation,
    initial_budget: u32,
    now: i64,
    /// Turns taken (accepted `TakeTurn`s).
    turns: u32,
    /// Messages delivered, counted per `Deliver` effect.
    delivers: u32,
    /// Whether the last accepted conclusion retriggered the initiator.
    retriggered: bool,
    /// Whether the next follow-up sever is lost to a crash.
    crash_next_sever: bool,
    /// Events accepted, in order (to run them again after a restart).
    accepted: Vec<ConversationEvent>,
    /// Whether the conversation was ever severed.
    was_severed: bool,
    /// Whether a crash skipped the sever that follows a spent budget.
    skipped_sever: bool,
}

impl Run {
    fn new(conversation: Conversation) -> Self {
        Self {
            initial_budget: conversation.budget_remaining,
            now: 0,
            turns: 0,
            delivers: 0,
            retriggered: false,
            crash_next_sever: false,
            accepted: Vec::new(),
            was_severed: conversation.status == ConversationStatus::Severed,
            skipped_sever: false,
            conversation,
        }
    }

    fn at(&mut self) -> Timestamp {
        self.now += 1;
        Timestamp(self.now)
    }

    /// Applies one event and checks every promise of `apply` about it.
    fn apply(&mut self, event: ConversationEvent) -> Result<(), TestCaseError> {
        let before = self.conversation.clone();
        let kind = event.kind();
        let by = match &event {
            ConversationEvent::Reopen { by, .. }
            | ConversationEvent::TakeTurn { by, .. }
            | ConversationEvent::Conclude { by, .. } => Some(by.clone()),
            ConversationEvent::Sever { by, .. } => by.clone(),
            other => panic!("unknown event {other:?}"),
        };
        let member = by.as_ref().is_none_or(|b| before.member(b).is_some());
        let replay = matches!(event, ConversationEvent::Conclude { replay: true, .. });
        let expected = allowed(before.status, kind, member, before.budget_remaining, replay);
        match before.apply(event.clone()) {
            Ok(t) => {
                let after = &t.conversation;
                let Some((status, changed)) = expected else {
                    return Err(TestCaseError::fail(format!(
                        "{kind} accepted from {} (member {member}, budget {})",
                        before.status, before.budget_remaining
                    )));
                };
                prop_assert_eq!(after.status, status, "{} from {}", kind, before.status);
                prop_assert_eq!(t.changed, changed, "{} from {}", kind, before.status);
                // The store would accept it: identity fixed, budget not raised, origin set once,
                // severed stays severed.
                prop_assert!(
                    before.check_successor(after).is_ok(),
                    "{:?}",
                    before.check_successor(after)
                );
                prop_assert_eq!(&after.members.len(), &before.members.len());
                if changed {
                    prop_assert_eq!(after.revision, before.revision + 1);
                    prop_assert_eq!(after.updated_at, event.at());
                } else {
                    prop_assert_eq!(after, &before);
                }
                let took_turn = kind == ConversationEventKind::TakeTurn;
                let spent = u32::from(took_turn);
                prop_assert_eq!(after.budget_remaining, before.budget_remaining - spent);
                prop_assert_eq!(
                    after.members.iter().all(|m| m.open),
                    after.status == ConversationStatus::Open
                );
                self.check_effects(&before, &event, &t.effects)?;
                self.turns += spent;
                self.accepted.push(event);
                self.conversation = t.conversation;
                if self.conversation.status == ConversationStatus::Severed {
                    self.was_severed = true;
                }
                // The service severs right after the turn that spent the budget (unless it crashed
                // in between: the next turn then finds the budget spent and severs).
                if t.effects
                    .iter()
                    .any(|e| matches!(e, Effect::SeverForBudget { .. }))
                {
                    if self.crash_next_sever {
                        self.crash_next_sever = false;
                        self.skipped_sever = true;
                    } else {
                        self.sever_for_budget()?;
                    }
                }
            }
            Err(e) => {
                prop_assert!(
                    expected.is_none(),
                    "{} from {} refused: {:?}",
                    kind,
                    before.status,
                    e
                );
                prop_assert_eq!(e.conversation(), &before.id);
                match &e {
                    TransitionError::BudgetSpent { .. } => {
                        prop_assert!(took_turn_refused_for_budget(&before, kind));
                        self.sever_for_budget()?;
                    }
                    TransitionError::NotMember { agent, .. } => {
                        prop_assert!(before.member(agent).is_none());
                    }
                    TransitionError::NotOpen { status, .. } => {
                        prop_assert_eq!(kind, ConversationEventKind::TakeTurn);
                        prop_assert_eq!(*status, before.status);
                        prop_assert!(*status != ConversationStatus::Open);
                    }
                    TransitionError::Invalid { status, event, .. } => {
                        prop_assert_eq!(*status, before.status);
                        prop_assert_eq!(*event, kind);
                    }
                    other => panic!("unknown refusal {other:?}"),
                }
            }
        }
        self.check_invariants()
    }

    /// Effects only where the table says the transition does something, and what they say is
    /// true of the record.
    fn check_effects(
        &mut self,
        before: &Conversation,
        event: &ConversationEvent,
        effects: &[Effect],
    ) -> Result<(), TestCaseError> {
        let kind = event.kind();
        let mut retriggered = false;
        for effect in effects {
            match effect {
                Effect::GiveRules => prop_assert!(false, "rules are given at creation only"),
                Effect::Opened => prop_assert_eq!(kind, ConversationEventKind::Reopen),
                Effect::RecordSent { from, text } => {
                    let ConversationEvent::TakeTurn {
                        by,
                        text: said,
                        sent_record: true,
                        ..
                    } = event
                    else {
                        return Err(TestCaseError::fail(format!("sent record on {kind}")));
                    };
                    prop_assert_eq!(&from.agent, by);
                    prop_assert_eq!(text, said);
                }
                Effect::Deliver { from, to, content } => {
                    let ConversationEvent::TakeTurn { by, text, .. } = event else {
                        return Err(TestCaseError::fail(format!("delivery on {kind}")));
                    };
                    prop_assert_eq!(&from.agent, by);
                    prop_assert!(content.ends_with(text.as_str()));
                    let others: Vec<&AgentId> = before
                        .members
                        .iter()
                        .filter(|m| &m.agent != by && m.open)
                        .map(|m| &m.agent)
                        .collect();
                    let to: Vec<&AgentId> = to.iter().map(|m| &m.agent).collect();
                    prop_assert_eq!(to, others);
                    self.delivers += 1;
                }
                Effect::MessageSent { .. } => {
                    prop_assert_eq!(kind, ConversationEventKind::TakeTurn)
                }
                Effect::SeverForBudget { .. } => {
                    prop_assert_eq!(kind, ConversationEventKind::TakeTurn);
                    prop_assert_eq!(before.budget_remaining, 1);
                }
                Effect::Retrigger {
                    initiator, channel, ..
                } => {
                    prop_assert_eq!(kind, ConversationEventKind::Conclude);
                    prop_assert_eq!(initiator, &before.initiator);
                    prop_assert_eq!(Some(channel), before.initiated_from.as_ref());
                    retriggered = true;
                }
                Effect::RecordConclusion { .. } | Effect::Concluded { .. } => {
                    prop_assert_eq!(kind, ConversationEventKind::Conclude);
                    prop_assert_eq!(before.status, ConversationStatus::Open);
                }
                Effect::RecordSevered { .. } | Effect::Severed { .. } => {
                    prop_assert_eq!(kind, ConversationEventKind::Sever);
                    prop_assert!(before.status != ConversationStatus::Severed);
                }
                other => panic!("unknown effect {other:?}"),
            }
        }
        let turn = kind == ConversationEventKind::TakeTurn;
        prop_assert_eq!(
            effects
                .iter()
                .filter(|e| matches!(e, Effect::Deliver { .. }))
                .count(),
            usize::from(turn)
        );
        if kind == ConversationEventKind::Conclude {
            self.retriggered = retriggered;
            prop_assert_eq!(retriggered, before.initiated_from.is_some());
        }
        Ok(())
    }

    fn sever_for_budget(&mut self) -> Result<(), TestCaseError> {
        let at = self.at();
        self.apply(ConversationEvent::Sever {
            by: None,
            reason: "its turn budget is spent".into(),
            at,
        })
    }

    fn check_invariants(&self) -> Result<(), TestCaseError> {
        let c = &self.conversation;
        // Turns never exceed the budget, and the budget only goes down by the turns taken: across
        // reopenings, retriggers, steers and restarts.
        prop_assert!(self.turns <= self.initial_budget);
        prop_assert_eq!(c.budget_remaining + self.turns, self.initial_budget);
        prop_assert_eq!(self.delivers, self.turns);
        // Severed is final.
        prop_assert_eq!(self.was_severed, c.status == ConversationStatus::Severed);
        Ok(())
    }

    fn run(&mut self, op: Op) -> Result<(), TestCaseError> {
        match op {
            Op::Reopen { by, origin } => {
                let at = self.at();
                self.apply(ConversationEvent::Reopen {
                    by: agent(by),
                    origin: origin.then(|| ChannelId::new("portal:chat:x")),
                    at,
                })
            }
            Op::Turn { by, sent_record } => self.turn(by, sent_record),
            Op::Steer { by } => {
                self.turn(by, false)?;
                self.turn(by, false)
            }
            Op::Retrigger => {
                if !self.retriggered {
                    return Ok(());
                }
                self.retriggered = false;
                let at = self.at();
                self.apply(ConversationEvent::Reopen {
                    by: id("a"),
                    origin: Some(ChannelId::new("portal:chat:a")),
                    at,
                })?;
                self.turn(0, true)
            }
            Op::Conclude { by, replay } => {
                let at = self.at();
                self.apply(ConversationEvent::Conclude {
                    by: agent(by),
                    summary: "done".into(),
                    replay,
                    at,
                })
            }
            Op::Sever { by } => {
                let at = self.at();
                self.apply(ConversationEvent::Sever {
                    by: by.map(agent),
                    reason: "no".into(),
                    at,
                })
            }
            Op::Restart => {
                self.conversation = reload(&self.conversation);
                self.check_invariants()
            }
            Op::CrashBeforeSever => {
                self.crash_next_sever = true;
                Ok(())
            }
        }
    }

    fn turn(&mut self, by: usize, sent_record: bool) -> Result<(), TestCaseError> {
        let at = self.at();
        self.apply(ConversationEvent::TakeTurn {
            by: agent(by),
            text: format!("turn {at:?}"),
            sent_record,
            at,
        })
    }
}

fn took_turn_refused_for_budget(before: &Conversation, kind: ConversationEventKind) -> bool {
    kind == ConversationEventKind::TakeTurn
        && before.status == ConversationStatus::Open
        && before.budget_remaining == 0
}

/// The record as a restarted process reads it: serialized and read back.
fn reload(c: &Conversation) -> Conversation {
    let text = serde_json::to_string(c).unwrap();
    let back: Conversation = serde_json::from_str(&text).unwrap();
    assert_eq!(&back, c, "a reload changes nothing");
    back
}

fn mode() -> impl Strategy<Value = ConversationMode> {
    prop_oneof![
        Just(ConversationMode::Mirrored),
        Just(ConversationMode::Group)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random interleavings of reopenings, turns, steered turns, result retriggers, conclusions,
    /// severs, restarts and crashes before a budget's sever: every accepted event is in the table,
    /// every refused one changes nothing, the turns taken never exceed the budget, and a severed
    /// conversation never opens again.
    #[test]
    fn apply_follows_the_table_and_keeps_the_budget(
        mode in mode(),
        size in 2usize..5,
        budget in 0u32..8,
        origin in any::<bool>(),
        ops in prop::collection::vec(op(), 0..60),
    ) {
        let mut run = Run::new(conversation(mode, size, budget, origin));
        for op in ops {
            run.run(op)?;
        }
        run.check_invariants()?;
        // A spent budget ends the conversation for good, unless a crash came before its sever (the
        // next turn severs it then).
        if run.turns == budget && budget > 0 && !run.skipped_sever {
            prop_assert_eq!(run.conversation.status, ConversationStatus::Severed);
        }
    }

    /// A restart runs the same events again (a turn run again after a crash asks for the same
    /// effects) on the reloaded record: the budget spent before the restart stays spent, so both
    /// runs together take no more turns than the budget, and the record never gains a turn.
    #[test]
    fn a_spent_budget_stays_spent_across_a_restart(
        mode in mode(),
        size in 2usize..5,
        budget in 0u32..8,
        origin in any::<bool>(),
        ops in prop::collection::vec(op(), 0..40),
    ) {
        let mut first = Run::new(conversation(mode, size, budget, origin));
        for op in ops {
            first.run(op)?;
        }
        let reloaded = reload(&first.conversation);
        let mut again = Run::new(reloaded.clone());
        again.now = first.now;
        for event in first.accepted.clone() {
            let event = match event {
                ConversationEvent::TakeTurn { by, text, sent_record, .. } => {
                    let at = again.at();
                    ConversationEvent::TakeTurn { by, text, sent_record, at }
                }
                ConversationEvent::Reopen { by, origin, .. } => {
                    let at = again.at();
                    ConversationEvent::Reopen { by, origin, at }
                }
                ConversationEvent::Conclude { by, summary, replay, .. } => {
                    let at = again.at();
                    ConversationEvent::Conclude { by, summary, replay, at }
                }
                ConversationEvent::Sever { by, reason, .. } => {
                    let at = again.at();
                    ConversationEvent::Sever { by, reason, at }
                }
                other => panic!("unknown event {other:?}"),
            };
            again.apply(event)?;
            prop_assert!(again.conversation.budget_remaining <= reloaded.budget_remaining);
        }
        prop_assert!(first.turns + again.turns <= budget, "{} + {} turns with a budget of {}", first.turns, again.turns, budget);
        if reloaded.status == ConversationStatus::Severed {
            prop_assert_eq!(again.turns, 0);
            prop_assert_eq!(&again.conversation, &reloaded);
        }
    }

    /// Whatever a member does from a severed conversation (reopen, speak, conclude, sever), it is
    /// refused or changes nothing, and yields no effect: closed is final.
    #[test]
    fn a_severed_conversation_stays_severed(
        mode in mode(),
        size in 2usize..5,
        budget in 0u32..8,
        ops in prop::collection::vec(op(), 0..30),
    ) {
        let mut c = conversation(mode, size, budget, true);
        c = c.apply(ConversationEvent::Sever { by: None, reason: "gone".into(), at: Timestamp(1) }).unwrap().conversation;
        let mut run = Run::new(c.clone());
        for op in ops {
            run.run(op)?;
            prop_assert_eq!(&run.conversation, &c);
        }
        prop_assert_eq!(run.turns, 0);
    }
}
