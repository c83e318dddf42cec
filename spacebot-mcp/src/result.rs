//! A tool result as the model sees it: text, structured content, resources, and placeholders
//! for images and audio, cut at the server's `max_result_bytes`.

use rmcp::model::CallToolResult;
use serde_json::Value;

/// The text the model is shown for `result`, and whether the server said it is an error.
/// Text blocks are kept as they are; structured content is shown as JSON when no block carries
/// text; an embedded text resource is shown with its URI, a binary one, an image or an audio
/// clip as a placeholder naming its type and size; a resource link by its URI. The whole is cut
/// at `cap` bytes (on a character boundary) and then says how large it was.
pub(crate) fn render(result: &CallToolResult, cap: usize) -> (String, bool) {
    let is_error = result.is_error.unwrap_or(false);
    let value = serde_json::to_value(result).unwrap_or(Value::Null);
    let mut parts: Vec<String> = Vec::new();
    let mut has_text = false;
    if let Some(blocks) = value.get("content").and_then(Value::as_array) {
        for block in blocks {
            let kind = block.get("type").and_then(Value::as_str).unwrap_or("");
            let str_of = |key: &str| block.get(key).and_then(Value::as_str).unwrap_or("");
            match kind {
                "text" => {
                    has_text = true;
                    parts.push(str_of("text").to_owned());
                }
                "image" | "audio" => parts.push(format!(
                    "[{kind}: {}, {} bytes, not shown]",
                    str_of("mimeType"),
                    base64_len(str_of("data"))
                )),
                "resource" => {
                    let resource = block.get("resource").cloned().unwrap_or(Value::Null);
                    let uri = resource.get("uri").and_then(Value::as_str).unwrap_or("");
                    if let Some(text) = resource.get("text").and_then(Value::as_str) {
                        has_text = true;
                        parts.push(format!("[resource {uri}]\n{text}"));
                    } else {
                        let blob = resource.get("blob").and_then(Value::as_str).unwrap_or("");
                        let mime = resource
                            .get("mimeType")
                            .and_then(Value::as_str)
                            .unwrap_or("application/octet-stream");
                        parts.push(format!(
                            "[resource {uri}: {mime}, {} bytes, not shown]",
                            base64_len(blob)
                        ));
                    }
                }
                "resource_link" => parts.push(format!(
                    "[resource link: {} ({})]",
                    str_of("uri"),
                    str_of("name")
                )),
                other => parts.push(format!("[content of type {other:?}, not shown]")),
            }
        }
    }
    if !has_text && let Some(structured) = value.get("structuredContent") {
        parts.push(structured.to_string());
    }
    let text = if parts.is_empty() {
        "(the tool returned nothing)".to_owned()
    } else {
        parts.join("\n")
    };
    (cap_text(text, cap), is_error)
}

/// Cuts `text` to at most `cap` bytes on a character boundary, and says so.
pub(crate) fn cap_text(text: String, cap: usize) -> String {
    if text.len() <= cap {
        return text;
    }
    let mut end = cap;
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    format!(
        "{}\n[result cut: it was {} bytes; only the first {end} are shown]",
        &text[..end],
        text.len()
    )
}

fn base64_len(data: &str) -> usize {
    data.len() / 4 * 3
}

#[cfg(test)]
mod tests {
    use super::cap_text;

    #[test]
    fn cap_cuts_on_a_character_boundary_and_says_so() {
        let text = "é".repeat(10); // 20 bytes
        let cut = cap_text(text.clone(), 5);
        assert!(cut.starts_with("éé\n"), "{cut}");
        assert!(cut.contains("it was 20 bytes; only the first 4 are shown"));
        assert_eq!(cap_text(text.clone(), 20), text);
    }
}
