//! The names the model sees: `{server}__{tool}`, within the OpenAI tool-name rules
//! (`^[a-zA-Z0-9_-]{1,64}$`).

use std::collections::BTreeSet;

/// The longest tool name a model is offered.
pub const MAX_NAME_LEN: usize = 64;

/// The name the model sees for the tool `tool` of the server `server`: `{server}__{tool}`, each
/// character outside `a-z A-Z 0-9 _ -` replaced by `_`; a name longer than 64 characters, or one
/// already in `taken`, is cut and ends with a hash of the tool's name, so every tool of a server
/// has its own name.
///
/// ```
/// use std::collections::BTreeSet;
/// use spacebot_mcp::exposed_name;
/// assert_eq!(exposed_name("files", "read_file", &BTreeSet::new()), "files__read_file");
/// assert_eq!(exposed_name("files", "read.file", &BTreeSet::new()), "files__read_file");
/// let long = exposed_name("files", &"x".repeat(100), &BTreeSet::new());
/// assert_eq!(long.len(), 64);
/// ```
pub fn exposed_name(server: &str, tool: &str, taken: &BTreeSet<String>) -> String {
    let clean: String = format!("{server}__{tool}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if clean.len() <= MAX_NAME_LEN && !taken.contains(&clean) {
        return clean;
    }
    let hash = format!("{:08x}", fnv(tool));
    let keep = MAX_NAME_LEN - hash.len() - 1;
    let mut cut: String = clean.chars().take(keep).collect();
    cut.push('_');
    cut.push_str(&hash);
    cut
}

/// FNV-1a, 32 bits: stable across processes and versions (the name must not change between
/// runs).
fn fnv(text: &str) -> u32 {
    let mut hash: u32 = 0x811c_9dc5;
    for byte in text.bytes() {
        hash ^= u32::from(byte);
        hash = hash.wrapping_mul(0x0100_0193);
    }
    hash
}
