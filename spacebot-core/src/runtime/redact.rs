//! Failure texts fit to leave the runtime: a failed turn's notice in the channel's history (which
//! the model reads), its failure reply to the application, a task's failure reason.
//!
//! A provider's error text may carry what only the operator should see: the server's URL (with
//! credentials or a key in its query, for some gateways), a bearer token, an API key the server
//! echoed back. [`redact`] takes them out; the kind of failure and the server's own words stay.

/// `text` without URLs and without what looks like a credential.
///
/// - A URL (`scheme://...`, up to a space, a quote or a closing bracket) becomes `[url]`, and
///   reqwest's `for url ([url])` is dropped whole.
/// - A word after `Bearer ` or `Basic `, and a word that looks like an API key (`sk-...`,
///   `sk_...`, `key-...`, `AIza...`, of 12 characters or more) become `[redacted]`.
/// - The value of a `key=`, `token=`, `secret=`, `password=`, `api_key=`, `api-key=` pair
///   becomes `[redacted]`.
///
/// ```
/// use spacebot_core::runtime::redact::redact;
///
/// let text = "transport error: error sending request for url \
///             (http://10.0.0.7:8089/v1/chat/completions?api-key=abc): connection refused";
/// assert_eq!(redact(text), "transport error: error sending request: connection refused");
/// assert_eq!(
///     redact("authentication failed: Incorrect API key provided: sk-proj-12345678901234"),
///     "authentication failed: Incorrect API key provided: [redacted]"
/// );
/// ```
pub fn redact(text: &str) -> String {
    let without_urls = redact_urls(text);
    let mut out = String::with_capacity(without_urls.len());
    let mut after_scheme = false;
    for (i, piece) in without_urls.split(' ').enumerate() {
        if i > 0 {
            out.push(' ');
        }
        if after_scheme && !piece.is_empty() {
            out.push_str(&redact_word(piece, true));
            after_scheme = false;
            continue;
        }
        after_scheme = matches!(piece, "Bearer" | "bearer" | "Basic" | "basic");
        out.push_str(&redact_word(piece, false));
    }
    out
}

/// Characters that end a URL in running text.
fn ends_url(c: char) -> bool {
    c.is_whitespace() || matches!(c, '"' | '\'' | ')' | ']' | '}' | '>' | '<' | '`')
}

fn redact_urls(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        // The scheme: the letters (and `+.-`) just before `://`.
        let scheme_len = rest[..at]
            .chars()
            .rev()
            .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '.' | '-'))
            .map(char::len_utf8)
            .sum::<usize>();
        if scheme_len == 0 {
            out.push_str(&rest[..at + 3]);
            rest = &rest[at + 3..];
            continue;
        }
        out.push_str(&rest[..at - scheme_len]);
        let tail = &rest[at + 3..];
        let mut end = tail.find(ends_url).unwrap_or(tail.len());
        // A sentence's punctuation after the URL stays.
        while end > 0 && tail[..end].ends_with(['.', ',', ';', ':']) {
            end -= 1;
        }
        out.push_str("[url]");
        rest = &tail[end..];
    }
    out.push_str(rest);
    out.replace(" for url ([url])", "")
        .replace(" for url [url]", "")
        .replace(" (url: [url])", "")
}

/// One space-separated word, redacted when it is (or carries) a credential.
fn redact_word(word: &str, credential: bool) -> String {
    let core = word.trim_matches(|c: char| !c.is_ascii_alphanumeric() && !"-_=".contains(c));
    if core.is_empty() {
        return word.to_owned();
    }
    if credential || looks_like_key(core) {
        return word.replacen(core, "[redacted]", 1);
    }
    let lower = core.to_ascii_lowercase();
    for name in [
        "api_key=",
        "api-key=",
        "apikey=",
        "key=",
        "token=",
        "secret=",
        "password=",
    ] {
        if let Some(at) = lower.find(name) {
            let value = core[at + name.len()..].trim_start_matches(['"', '\'']);
            if !value.is_empty() {
                return word.replacen(value, "[redacted]", 1);
            }
        }
    }
    word.to_owned()
}

fn looks_like_key(word: &str) -> bool {
    const PREFIXES: [&str; 4] = ["sk-", "sk_", "key-", "AIza"];
    word.len() >= 12
        && PREFIXES.iter().any(|p| word.starts_with(p))
        && word
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '*' | '.'))
}

#[cfg(test)]
mod tests {
    use super::redact;

    #[test]
    fn urls_and_credentials_go_the_rest_stays() {
        for (text, expected) in [
            (
                "transport error: error sending request for url (http://127.0.0.1:8089/v1/chat/completions): client error (Connect): tcp connect error: Connection refused (os error 111)",
                "transport error: error sending request: client error (Connect): tcp connect error: Connection refused (os error 111)",
            ),
            (
                "server error (HTTP 502): see https://status.example.com/x, then retry",
                "server error (HTTP 502): see [url], then retry",
            ),
            (
                "Authorization: Bearer abc.def-ghi failed",
                "Authorization: Bearer [redacted] failed",
            ),
            (
                "bad request: key=hunter2 token=\"s3cret\"",
                "bad request: key=[redacted] token=\"[redacted]\"",
            ),
            (
                "Incorrect API key provided: sk-test-****-key.",
                "Incorrect API key provided: [redacted].",
            ),
            ("timed out after 30s", "timed out after 30s"),
            ("a://", "[url]"),
            ("://x", "://x"),
            ("", ""),
        ] {
            assert_eq!(redact(text), expected, "{text}");
        }
    }

    #[test]
    fn never_panics_on_odd_text() {
        for text in [
            "é://ü",
            "ü://",
            "x:// ",
            "Bearer",
            "Bearer ",
            "key=",
            "sk-ééééééééééééé",
            "https://a.b/c?key=1 and http://",
        ] {
            let out = redact(text);
            assert!(!out.contains("a.b/c"), "{out}");
        }
    }
}
