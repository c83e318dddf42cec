//! The tools: `list_shared_notes`, `read_shared_note`, `write_shared_note`.
//!
//! Each is offered only to agents with access to at least one note
//! ([`Tool::offered_to`](spacebot_core::Tool::offered_to)), and each call checks the calling
//! agent's access to the note it names against the grants stored now, whatever the model asks.

use std::fmt::Write as _;
use std::sync::Arc;

use async_trait::async_trait;
use serde::Deserialize;
use serde_json::json;
use spacebot_core::tools::{ToolCapability, ToolContext, ToolError, ToolOutput, TypedTool};
use spacebot_core::{AgentId, Tool};

use crate::model::{Access, NoteName, NotesError};
use crate::notes::Notes;

/// The tool that lists the notes the agent may read.
pub const LIST_TOOL: &str = "list_shared_notes";
/// The tool that reads a note.
pub const READ_TOOL: &str = "read_shared_note";
/// The tool that writes a note.
pub const WRITE_TOOL: &str = "write_shared_note";

pub(crate) fn tools(notes: &Notes) -> Vec<Arc<dyn Tool>> {
    vec![
        Arc::new(ListNotes(notes.clone())),
        Arc::new(ReadNote(notes.clone())),
        Arc::new(WriteNote(notes.clone())),
    ]
}

fn failed(tool: &str, error: NotesError) -> ToolError {
    ToolError::failed(tool, error.to_string())
}

fn no_access(tool: &str, name: &str) -> ToolError {
    ToolError::failed(
        tool,
        format!(
            "you have no access to a shared note named {name:?}; {LIST_TOOL} shows the notes you may use"
        ),
    )
}

fn parse_name(tool: &str, name: &str) -> Result<NoteName, ToolError> {
    NoteName::parse(name).map_err(|e| ToolError::invalid_arguments(tool, e.to_string()))
}

fn your_notes(notes: &Notes, agent: &AgentId) -> String {
    let mine = notes.cached_for(agent);
    if mine.is_empty() {
        return String::new();
    }
    let list: Vec<String> = mine
        .iter()
        .map(|(name, access)| format!("{name} ({access})"))
        .collect();
    format!(" Your notes: {}.", list.join(", "))
}

/// `list_shared_notes`.
#[derive(Debug)]
struct ListNotes(Notes);

/// `list_shared_notes` takes no arguments.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListArgs {}

#[async_trait]
impl TypedTool for ListNotes {
    const NAME: &'static str = LIST_TOOL;
    type Args = ListArgs;

    fn description(&self) -> String {
        "Lists the shared notes you may read: name, description, your access (read or \
         read_write) and the latest version."
            .to_owned()
    }

    fn parameters(&self) -> serde_json::Value {
        json!({"type": "object", "properties": {}, "additionalProperties": false})
    }

    fn offered_to(&self, scope: &ToolCapability) -> bool {
        self.0.offered(scope.agent())
    }

    async fn run(&self, ctx: &ToolContext, _args: ListArgs) -> Result<ToolOutput, ToolError> {
        let notes = self
            .0
            .readable_by(&ctx.agent)
            .await
            .map_err(|e| failed(LIST_TOOL, e))?;
        if notes.is_empty() {
            return Ok(ToolOutput::text("You have no shared notes."));
        }
        let mut out = String::from("Your shared notes:\n");
        for (note, access) in notes {
            let version = note.latest.as_ref().map_or(0, |v| v.version);
            let _ = write!(out, "- {} (access: {access}, version {version})", note.name);
            if !note.description.is_empty() {
                let _ = write!(out, ": {}", note.description);
            }
            out.push('\n');
        }
        Ok(ToolOutput::text(out))
    }
}

/// `read_shared_note`.
#[derive(Debug)]
struct ReadNote(Notes);

/// The arguments of `read_shared_note`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadArgs {
    name: String,
}

#[async_trait]
impl TypedTool for ReadNote {
    const NAME: &'static str = READ_TOOL;
    type Args = ReadArgs;

    fn description(&self) -> String {
        "Reads a shared note: its text and its version. Pass that version as base_version when you \
         write the note."
            .to_owned()
    }

    fn description_for(&self, scope: &ToolCapability) -> String {
        format!(
            "{}{}",
            self.description(),
            your_notes(&self.0, scope.agent())
        )
    }

    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {"name": {"type": "string", "description": "The note's name."}},
            "required": ["name"],
            "additionalProperties": false
        })
    }

    fn offered_to(&self, scope: &ToolCapability) -> bool {
        self.0.offered(scope.agent())
    }

    async fn run(&self, ctx: &ToolContext, args: ReadArgs) -> Result<ToolOutput, ToolError> {
        let name = parse_name(READ_TOOL, &args.name)?;
        let Some(access) = self
            .0
            .access_of(&name, &ctx.agent)
            .await
            .map_err(|e| failed(READ_TOOL, e))?
        else {
            return Err(no_access(READ_TOOL, &args.name));
        };
        let latest = self
            .0
            .latest_version(&name)
            .await
            .map_err(|e| failed(READ_TOOL, e))?;
        Ok(ToolOutput::text(match latest {
            Some(v) => format!(
                "Note {name} (version {}, written by {}; your access: {access}):\n{}",
                v.version, v.author, v.text
            ),
            None => {
                format!("Note {name} has not been written yet (version 0; your access: {access}).")
            }
        }))
    }
}

/// `write_shared_note`.
#[derive(Debug)]
struct WriteNote(Notes);

/// The arguments of `write_shared_note`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WriteArgs {
    name: String,
    text: String,
    #[serde(default)]
    base_version: Option<u64>,
}

#[async_trait]
impl TypedTool for WriteNote {
    const NAME: &'static str = WRITE_TOOL;
    type Args = WriteArgs;

    fn description(&self) -> String {
        "Replaces the text of a shared note you may write. base_version is the version you read \
         (0 or absent for a note not written yet): if someone wrote the note since, nothing is \
         written and you are shown the current text and version to merge your change into."
            .to_owned()
    }

    fn description_for(&self, scope: &ToolCapability) -> String {
        format!(
            "{}{}",
            self.description(),
            your_notes(&self.0, scope.agent())
        )
    }

    fn parameters(&self) -> serde_json::Value {
        json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "description": "The note's name."},
                "text": {"type": "string", "description": "The note's whole new text."},
                "base_version": {"type": "integer", "minimum": 0,
                                 "description": "The version you read (0 for a new note)."}
            },
            "required": ["name", "text"],
            "additionalProperties": false
        })
    }

    fn offered_to(&self, scope: &ToolCapability) -> bool {
        self.0.offered(scope.agent())
    }

    async fn run(&self, ctx: &ToolContext, args: WriteArgs) -> Result<ToolOutput, ToolError> {
        let name = parse_name(WRITE_TOOL, &args.name)?;
        match self
            .0
            .access_of(&name, &ctx.agent)
            .await
            .map_err(|e| failed(WRITE_TOOL, e))?
        {
            None => return Err(no_access(WRITE_TOOL, &args.name)),
            Some(Access::Read) => {
                return Err(ToolError::failed(
                    WRITE_TOOL,
                    format!("you may read note {name} but not write it"),
                ));
            }
            Some(Access::ReadWrite) => {}
        }
        let base = args.base_version.unwrap_or(0);
        match self
            .0
            .write_as_agent(name.as_str(), &args.text, base, &ctx.agent, &ctx.key)
            .await
        {
            Ok(written) => Ok(ToolOutput::text(format!(
                "Wrote note {name}: it is now at version {}.",
                written.version.version
            ))),
            Err(NotesError::Conflict { current, .. }) => Err(ToolError::failed(
                WRITE_TOOL,
                match current {
                    Some(c) => format!(
                        "note {name} is at version {} (written by {}), not at version {base} that \
                         your write was based on; nothing was written. Its current text:\n{}\n\
                         Merge your change into this text and write again with base_version {}.",
                        c.version, c.author, c.text, c.version
                    ),
                    None => format!(
                        "note {name} has not been written yet; nothing was written. Write again \
                         with base_version 0."
                    ),
                },
            )),
            Err(e) => Err(failed(WRITE_TOOL, e)),
        }
    }
}
