//! Behaviour scenarios through the public API, each taking the stores to run on.
#![allow(unreachable_pub)]
pub mod agent;
pub mod context;
pub mod conversation_group;
pub mod conversation_mirrored;
pub mod delegation_adversarial;
pub mod delegation_policies;
pub mod delegation_roundtrip;
pub mod governance;
pub mod governance_props;
pub mod junctions;
pub mod offers;
pub mod support;
