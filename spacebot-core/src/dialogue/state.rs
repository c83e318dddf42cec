//! The pure core of a conversation: [`Conversation::apply`] takes a [`ConversationEvent`] and
//! returns the next record with the [`Effect`]s to carry out once that record is stored, or a
//! [`TransitionError`] for a transition the lifecycle does not allow. No I/O, no clock: the time is
//! in the event.
//!
//! | From | Event | To | Effects |
//! | --- | --- | --- | --- |
//! | (new) | [`Transition::created`] | open | rules for every member, opened |
//! | concluded | `Reopen` | open (same budget, history, `initiated_from` kept once set) | opened |
//! | open, budget > 0 | `TakeTurn` | open, one turn less | sent record, deliveries, message sent; a sever for the budget when it reached 0 |
//! | open, budget 0 | `TakeTurn` | refused: [`TransitionError::BudgetSpent`] | |
//! | open | `Conclude` | concluded | result retrigger, conclusion records, concluded |
//! | concluded | `Conclude` replayed | unchanged | result retrigger (the receiver applies it once) |
//! | open or concluded | `Sever` | severed | severed notices, severed |
//! | severed | `Sever` | unchanged | none |
//!
//! Anything else is refused: a severed conversation never opens again, nobody speaks in one that is
//! not open, and nothing raises a budget.

use serde::{Deserialize, Serialize};

use crate::conversation::{Conversation, ConversationMode, ConversationStatus, Member};
use crate::ids::{AgentId, ChannelId, ConversationId};
use crate::time::Timestamp;

/// Something that happens to a conversation. Applied by [`Conversation::apply`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "event")]
#[non_exhaustive]
pub enum ConversationEvent {
    /// A concluded conversation opened again by `by`: the same record, its remaining budget and
    /// its history. `origin` becomes `initiated_from` only if none was set and `by` is the
    /// initiator.
    Reopen {
        /// The member opening it again.
        by: AgentId,
        /// The channel the opening call came from (none from the conversation's own channel).
        origin: Option<ChannelId>,
        /// When.
        at: Timestamp,
    },
    /// `by` says `text` to the other open members: one turn of the budget.
    TakeTurn {
        /// The speaking member.
        by: AgentId,
        /// What crosses (already distilled).
        text: String,
        /// Whether a history-only copy goes into the speaker's own channel (a send by tool; a
        /// final answer is in the speaker's history already).
        sent_record: bool,
        /// When.
        at: Timestamp,
    },
    /// `by` ends the open conversation with `summary` (a conclusion, or the initiator's close).
    Conclude {
        /// The concluding member.
        by: AgentId,
        /// The summary or final message.
        summary: String,
        /// The same call ran before (its turn runs again after a crash or a hand-over): a
        /// conversation it concluded already is left as it is and only the result is sent again.
        replay: bool,
        /// When.
        at: Timestamp,
    },
    /// Every membership ends at once, for good.
    Sever {
        /// Who severed it (none: the application, from outside).
        by: Option<AgentId>,
        /// Why, for the notices.
        reason: String,
        /// When.
        at: Timestamp,
    },
}

/// The name of a [`ConversationEvent`], for errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[allow(missing_docs)]
#[non_exhaustive]
pub enum ConversationEventKind {
    Reopen,
    TakeTurn,
    Conclude,
    Sever,
}

crate::link::text_enum!(ConversationEventKind, "conversation event", [
    Reopen => "reopen", TakeTurn => "take_turn", Conclude => "conclude", Sever => "sever",
]);

impl ConversationEvent {
    /// The event's name.
    pub fn kind(&self) -> ConversationEventKind {
        match self {
            Self::Reopen { .. } => ConversationEventKind::Reopen,
            Self::TakeTurn { .. } => ConversationEventKind::TakeTurn,
            Self::Conclude { .. } => ConversationEventKind::Conclude,
            Self::Sever { .. } => ConversationEventKind::Sever,
        }
    }

    /// When it happens.
    pub fn at(&self) -> Timestamp {
        match self {
            Self::Reopen { at, .. }
            | Self::TakeTurn { at, .. }
            | Self::Conclude { at, .. }
            | Self::Sever { at, .. } => *at,
        }
    }
}

/// What the service does after a transition was stored, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Effect {
    /// Write the anti-chattiness rules into every member's channel (at creation only).
    GiveRules,
    /// Emit `ConversationOpened` (a creation or a reopening).
    Opened,
    /// A history-only sent record of `text` in the speaker's own channel.
    RecordSent {
        /// The speaker.
        from: Member,
        /// What was said.
        text: String,
    },
    /// Hand `content` to each of `to` as a user message that wakes it (and emit `MessageReceived`
    /// for each delivery that lands). A delivery that fails for one member does not stop the others.
    Deliver {
        /// The speaker.
        from: Member,
        /// The other open members.
        to: Vec<Member>,
        /// What they receive (in a group, prefixed with the speaker's name).
        content: String,
    },
    /// Emit `MessageSent` for the speaker.
    MessageSent {
        /// The speaker.
        from: Member,
        /// The first other member.
        to: AgentId,
    },
    /// The turn just taken was the last one: sever the conversation (a transition of its own, after
    /// the delivery).
    SeverForBudget {
        /// The member whose turn spent the budget.
        by: AgentId,
    },
    /// Wake the initiator's `initiated_from` channel with the result (only when it is set).
    Retrigger {
        /// The initiator.
        initiator: AgentId,
        /// Its `initiated_from` channel.
        channel: ChannelId,
        /// The concluding member.
        by: AgentId,
        /// The summary.
        summary: String,
    },
    /// The conclusion in every member's channel without waking anyone (a sent record for its
    /// author).
    RecordConclusion {
        /// The concluding member.
        by: AgentId,
        /// The summary.
        summary: String,
    },
    /// Emit `ConversationConcluded`.
    Concluded {
        /// The concluding member.
        by: AgentId,
    },
    /// A history-only notice in every member's channel and in `initiated_from`.
    RecordSevered {
        /// Who severed it.
        by: Option<AgentId>,
        /// Why.
        reason: String,
    },
    /// Emit `ConversationSevered`.
    Severed {
        /// Who severed it.
        by: Option<AgentId>,
        /// Why.
        reason: String,
    },
}

/// The outcome of [`Conversation::apply`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transition {
    /// The conversation after the event (revision incremented, `updated_at` set), or as it was when
    /// `changed` is false.
    pub conversation: Conversation,
    /// Whether there is anything to store.
    pub changed: bool,
    /// What to do once the change is stored (or at once, when nothing changed).
    pub effects: Vec<Effect>,
}

impl Transition {
    /// The transition that brings a new, open conversation into being: its members get the rules
    /// and the opening is announced.
    pub fn created(conversation: Conversation) -> Self {
        Self {
            conversation,
            changed: true,
            effects: vec![Effect::GiveRules, Effect::Opened],
        }
    }

    fn unchanged(conversation: &Conversation, effects: Vec<Effect>) -> Self {
        Self {
            conversation: conversation.clone(),
            changed: false,
            effects,
        }
    }
}

/// Why [`Conversation::apply`] refused an event. Nothing changes and nothing is to be done.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransitionError {
    /// The agent is not a member of the conversation.
    #[error("{agent} is not a member")]
    NotMember {
        /// The conversation.
        conversation: ConversationId,
        /// The agent.
        agent: AgentId,
    },
    /// A turn in a conversation that is not open.
    #[error("it is {status}; nothing was delivered")]
    NotOpen {
        /// The conversation.
        conversation: ConversationId,
        /// Its status.
        status: ConversationStatus,
    },
    /// A turn in an open conversation with no turn left: it must be severed.
    #[error("its turn budget is spent; it was severed and nothing was delivered")]
    BudgetSpent {
        /// The conversation.
        conversation: ConversationId,
    },
    /// The event does not apply in this status (a conclusion of a conversation that ended, a
    /// reopening of one that is open or severed).
    #[error("it is {status} already")]
    Invalid {
        /// The conversation.
        conversation: ConversationId,
        /// Its status.
        status: ConversationStatus,
        /// The event.
        event: ConversationEventKind,
    },
}

impl TransitionError {
    /// The conversation the refused event was about.
    pub fn conversation(&self) -> &ConversationId {
        match self {
            Self::NotMember { conversation, .. }
            | Self::NotOpen { conversation, .. }
            | Self::BudgetSpent { conversation }
            | Self::Invalid { conversation, .. } => conversation,
        }
    }
}

impl Conversation {
    /// Applies `event`: the conversation's lifecycle as a pure function (see the table in
    /// [`dialogue::state`](crate::dialogue::state)).
    ///
    /// ```
    /// use spacebot_core::conversation::{Conversation, ConversationMode, ConversationStatus, Member, MemberRole};
    /// use spacebot_core::dialogue::{ConversationEvent, Effect};
    /// use spacebot_core::{AgentId, ChannelId, ConversationId, Timestamp};
    /// let (a, b) = (AgentId::parse("a").unwrap(), AgentId::parse("b").unwrap());
    /// let member = |agent: &AgentId, peer: &AgentId, number, role| Member {
    ///     agent: agent.clone(), channel: ChannelId::link(agent, peer), name: agent.to_string(),
    ///     number, role, open: true,
    /// };
    /// let c = Conversation {
    ///     id: ConversationId::new("c1"), mode: ConversationMode::Mirrored,
    ///     members: vec![member(&a, &b, 1, MemberRole::Initiator), member(&b, &a, 2, MemberRole::Responder)],
    ///     initiator: a.clone(), initiated_from: None, status: ConversationStatus::Open,
    ///     budget_remaining: 1, pair_key: None, summary: None, revision: 1,
    ///     created_at: Timestamp(0), updated_at: Timestamp(0),
    /// };
    /// let turn = |c: &Conversation| c.apply(ConversationEvent::TakeTurn {
    ///     by: a.clone(), text: "hello".into(), sent_record: true, at: Timestamp(1),
    /// });
    /// let last = turn(&c).unwrap();
    /// assert_eq!(last.conversation.budget_remaining, 0);
    /// assert!(last.effects.contains(&Effect::SeverForBudget { by: a.clone() }));
    /// assert!(turn(&last.conversation).is_err()); // a spent budget is never exceeded
    /// ```
    pub fn apply(&self, event: ConversationEvent) -> Result<Transition, TransitionError> {
        use ConversationStatus as S;
        let mut next = self.clone();
        let effects = match (&self.status, &event) {
            (S::Concluded, ConversationEvent::Reopen { by, origin, .. }) => {
                self.member_of(by)?;
                next.status = S::Open;
                for m in &mut next.members {
                    m.open = true;
                }
                if next.initiated_from.is_none() && &next.initiator == by {
                    next.initiated_from = origin.clone();
                }
                vec![Effect::Opened]
            }
            (
                status,
                ConversationEvent::TakeTurn {
                    by,
                    text,
                    sent_record,
                    ..
                },
            ) => {
                let from = self.member_of(by)?.clone();
                if *status != S::Open {
                    return Err(TransitionError::NotOpen {
                        conversation: self.id.clone(),
                        status: *status,
                    });
                }
                if self.budget_remaining == 0 {
                    return Err(TransitionError::BudgetSpent {
                        conversation: self.id.clone(),
                    });
                }
                next.budget_remaining -= 1;
                self.turn_effects(&next, from, text, *sent_record)
            }
            (S::Open, ConversationEvent::Conclude { by, summary, .. }) => {
                self.member_of(by)?;
                next.status = S::Concluded;
                next.summary = Some(summary.clone());
                for m in &mut next.members {
                    m.open = false;
                }
                let mut effects = self.retrigger(by, summary);
                effects.push(Effect::RecordConclusion {
                    by: by.clone(),
                    summary: summary.clone(),
                });
                effects.push(Effect::Concluded { by: by.clone() });
                effects
            }
            (
                S::Concluded,
                ConversationEvent::Conclude {
                    by,
                    summary,
                    replay: true,
                    ..
                },
            ) => {
                // The first run concluded it and stopped before its result was marked sent.
                self.member_of(by)?;
                return Ok(Transition::unchanged(self, self.retrigger(by, summary)));
            }
            (S::Severed, ConversationEvent::Sever { .. }) => {
                return Ok(Transition::unchanged(self, Vec::new()));
            }
            (S::Open | S::Concluded, ConversationEvent::Sever { by, reason, .. }) => {
                next.status = S::Severed;
                for m in &mut next.members {
                    m.open = false;
                }
                vec![
                    Effect::RecordSevered {
                        by: by.clone(),
                        reason: reason.clone(),
                    },
                    Effect::Severed {
                        by: by.clone(),
                        reason: reason.clone(),
                    },
                ]
            }
            (status, _) => {
                return Err(TransitionError::Invalid {
                    conversation: self.id.clone(),
                    status: *status,
                    event: event.kind(),
                });
            }
        };
        next.revision = self.revision + 1;
        next.updated_at = event.at();
        Ok(Transition {
            conversation: next,
            changed: true,
            effects,
        })
    }

    fn member_of(&self, agent: &AgentId) -> Result<&Member, TransitionError> {
        self.member(agent)
            .ok_or_else(|| TransitionError::NotMember {
                conversation: self.id.clone(),
                agent: agent.clone(),
            })
    }

    /// The effects of a turn `from` took, `next` being the conversation after it.
    fn turn_effects(
        &self,
        next: &Conversation,
        from: Member,
        text: &str,
        sent_record: bool,
    ) -> Vec<Effect> {
        let mut effects = Vec::new();
        if sent_record {
            effects.push(Effect::RecordSent {
                from: from.clone(),
                text: text.to_string(),
            });
        }
        let content = match self.mode {
            ConversationMode::Mirrored => text.to_string(),
            ConversationMode::Group => format!("[{}] {text}", from.name),
        };
        let to = next
            .members
            .iter()
            .filter(|m| m.agent != from.agent && m.open)
            .cloned()
            .collect();
        let first_other = next
            .members
            .iter()
            .find(|m| m.agent != from.agent)
            .map_or_else(|| from.agent.clone(), |m| m.agent.clone());
        let by = from.agent.clone();
        effects.push(Effect::Deliver {
            from: from.clone(),
            to,
            content,
        });
        effects.push(Effect::MessageSent {
            from,
            to: first_other,
        });
        if next.budget_remaining == 0 {
            effects.push(Effect::SeverForBudget { by });
        }
        effects
    }

    /// The result retrigger of a conclusion by `by`, when the conversation has a channel to wake.
    fn retrigger(&self, by: &AgentId, summary: &str) -> Vec<Effect> {
        self.initiated_from
            .iter()
            .map(|channel| Effect::Retrigger {
                initiator: self.initiator.clone(),
                channel: channel.clone(),
                by: by.clone(),
                summary: summary.to_string(),
            })
            .collect()
    }
}
