//! Context windows: an agent with a small window and a long history never sends a request over
//! its window, compaction keeps a tool call with its results, and the summary survives a restart.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use spacebot::context::{SUMMARY_INSTRUCTIONS, SUMMARY_NAMESPACE, Summary, answer_room};
use spacebot::limits::estimate_input;
use spacebot::testing::FnLlm;
use spacebot::testing::tools::EchoTool;
use spacebot::{
    ChatMessage, ChatRequest, ChatResponse, EventKind, NewRecord, RecordKind, Stores, Timestamp,
};

use super::support::{build, chat, id, portal};

const WINDOW: u64 = 2_000;

fn config(extra: &str) -> String {
    format!("[[agents]]\nid = \"a\"\ncontext_window = {WINDOW}\n{extra}")
}

/// Writes `n` records (user and assistant in turn, 90 to 290 bytes each) to agent `a`'s chat.
async fn seed(stores: &Stores, n: usize) {
    for i in 0..n {
        let (kind, author) = if i % 2 == 0 {
            (RecordKind::User, "user")
        } else {
            (RecordKind::Assistant, "a")
        };
        let text = format!("old message {i:03} {}", "lorem ipsum ".repeat(6 + i % 17));
        stores
            .channels
            .append(
                &id("a"),
                NewRecord::new(portal("a"), kind, author, text, Timestamp(1)),
            )
            .await
            .unwrap();
    }
}

fn is_summary_request(req: &ChatRequest) -> bool {
    matches!(req.messages.first(), Some(ChatMessage::System { content }) if content.as_str() == SUMMARY_INSTRUCTIONS)
}

/// A model that answers summary requests with `SUMMARY n`, and every other message with
/// `rounds` rounds of two `echo` calls (long arguments) before its answer.
fn model(rounds: usize) -> Arc<FnLlm> {
    let summaries = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicUsize::new(0));
    Arc::new(FnLlm::new(move |req| {
        if is_summary_request(req) {
            let n = summaries.fetch_add(1, Ordering::SeqCst);
            return Ok(ChatResponse::text(format!("SUMMARY {n}")));
        }
        match req.messages.last() {
            Some(ChatMessage::Tool { .. }) => {
                done.fetch_add(1, Ordering::SeqCst);
            }
            _ => done.store(0, Ordering::SeqCst),
        }
        let round = done.load(Ordering::SeqCst);
        if round >= rounds {
            return Ok(ChatResponse::text("answered"));
        }
        let text = format!("round {round} {}", "payload ".repeat(10));
        Ok(ChatResponse::tool_calls(vec![
            spacebot::testing::tool_call("echo", serde_json::json!({ "text": text })),
            spacebot::testing::tool_call("echo", serde_json::json!({ "text": "second" })),
        ]))
    }))
}

/// Every request fits the window (the answer's room kept), and every tool call is sent with all
/// its results, every result with its call.
fn check_requests(requests: &[ChatRequest]) {
    assert!(!requests.is_empty());
    for (n, req) in requests.iter().enumerate() {
        let used = estimate_input(req) + answer_room(WINDOW, req.max_tokens);
        assert!(
            used <= WINDOW,
            "request {n} takes {used} tokens, over the window of {WINDOW}"
        );
        for (i, message) in req.messages.iter().enumerate() {
            if let ChatMessage::Assistant { tool_calls, .. } = message {
                let results: Vec<&str> = req.messages[i + 1..]
                    .iter()
                    .map_while(|m| match m {
                        ChatMessage::Tool { tool_call_id, .. } => Some(tool_call_id.as_str()),
                        _ => None,
                    })
                    .collect();
                let calls: Vec<&str> = tool_calls.iter().map(|c| c.id.as_str()).collect();
                assert_eq!(results, calls, "request {n}: a call without its results");
            }
            if let ChatMessage::Tool { tool_call_id, .. } = message {
                let call = req.messages[..i]
                    .iter()
                    .rev()
                    .find(|m| !matches!(m, ChatMessage::Tool { .. }));
                let call = match call {
                    Some(ChatMessage::Assistant { tool_calls, .. }) => Some(tool_calls),
                    _ => None,
                };
                assert!(
                    call.is_some_and(|calls| calls.iter().any(|c| &c.id == tool_call_id)),
                    "request {n}: result {tool_call_id} without its call"
                );
            }
        }
    }
}

/// An agent with a 2,000-token window and a 500-record history answers three messages, each
/// after tool rounds: no request the model gets is over the window; the history was compacted.
pub async fn a_small_window_is_never_overflowed(stores: Stores) {
    seed(&stores, 500).await;
    let llm = model(3);
    let mut h = build(config(""), stores, llm.clone(), vec![Arc::new(EchoTool)]).await;
    h.org.start_all().await.unwrap();
    for text in ["first", "second", "third"] {
        h.org.deliver("a", chat("a", text)).await.unwrap();
        let reply = h.reply().await;
        assert_eq!(reply.content, "answered", "{reply:?}");
    }
    let requests = llm.requests();
    check_requests(&requests);
    assert!(requests.iter().any(is_summary_request), "compacted");
    assert!(h.count(|k| matches!(k, EventKind::Compacted { .. })) >= 1);
    let last = requests
        .iter()
        .rev()
        .find(|r| !is_summary_request(r))
        .unwrap();
    assert!(
        last.messages
            .iter()
            .any(|m| matches!(m, ChatMessage::System { content } if content.contains("SUMMARY"))),
        "the summary is sent: {:?}",
        last.messages
    );
}

/// A turn whose own tool rounds outgrow the window is compacted mid-turn: every request keeps
/// each tool call with its results (the summary request's transcript too).
pub async fn compaction_keeps_tool_calls_with_their_results(stores: Stores) {
    seed(&stores, 20).await;
    let llm = model(12);
    let mut h = build(config(""), stores, llm.clone(), vec![Arc::new(EchoTool)]).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "work long")).await.unwrap();
    assert_eq!(h.reply().await.content, "answered");
    let requests = llm.requests();
    check_requests(&requests);
    let summaries: Vec<&ChatRequest> = requests.iter().filter(|r| is_summary_request(r)).collect();
    assert!(!summaries.is_empty(), "the turn compacted");
    let last = requests.last().unwrap();
    assert_eq!(
        spacebot::testing::last_user_text(&last.messages),
        "work long",
        "the turn's message is always sent"
    );
}

/// With `compaction = false` nothing is summarized: older history is left out, and still no
/// request is over the window.
pub async fn without_compaction_older_history_is_left_out(stores: Stores) {
    seed(&stores, 500).await;
    let llm = model(2);
    let config = config("\n[settings]\ncompaction = false\n");
    let mut h = build(config, stores, llm.clone(), vec![Arc::new(EchoTool)]).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "hello")).await.unwrap();
    assert_eq!(h.reply().await.content, "answered");
    let requests = llm.requests();
    check_requests(&requests);
    assert!(!requests.iter().any(is_summary_request));
    assert!(
        requests[0].messages.len() > 5,
        "the newest history is sent: {}",
        requests[0].messages.len()
    );
}

/// What an agent keeps of its channel between turns is joined to every record appended since,
/// however many: a few (fewer than a page) and many (more than a page, when the channel is read
/// again), in a window that holds them all. The model's last request of each turn carries every
/// one of them, in order, after the turn before.
pub async fn records_appended_between_turns_are_all_sent(stores: Stores) {
    let llm = Arc::new(FnLlm::new(|_| Ok(ChatResponse::text("answered"))));
    let config = "[[agents]]\nid = \"a\"\ncontext_window = 200000\n".to_string();
    let mut h = build(config, stores.clone(), llm.clone(), Vec::new()).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "turn one")).await.unwrap();
    assert_eq!(h.reply().await.content, "answered");
    let mut appended = 0;
    for (turn, between) in [("turn two", 10), ("turn three", 150)] {
        let texts: Vec<String> = (appended..appended + between)
            .map(|i| format!("appended {i:03}"))
            .collect();
        appended += between;
        for text in &texts {
            let record = NewRecord::new(portal("a"), RecordKind::User, "user", text, Timestamp(1));
            stores.channels.append(&id("a"), record).await.unwrap();
        }
        h.org.deliver("a", chat("a", turn)).await.unwrap();
        assert_eq!(h.reply().await.content, "answered");
        let sent = spacebot::testing::user_texts(&llm.requests().last().unwrap().messages);
        let from = sent.iter().position(|t| t.contains("turn one"));
        let at = |text: &str| sent.iter().position(|t| t.contains(text));
        let positions: Vec<Option<usize>> = texts.iter().map(|t| at(t)).collect();
        assert!(
            from.is_some() && positions.iter().all(Option::is_some),
            "{turn}: every record appended since is sent: {sent:?}"
        );
        assert!(
            positions.windows(2).all(|w| w[0] < w[1]) && positions[0] > from,
            "{turn}: in order, after the turn before: {sent:?}"
        );
        assert!(
            at(turn) > positions.last().copied().flatten(),
            "{turn}: last"
        );
    }
}

/// A message larger than a configured window fails the turn without calling the model, and the
/// user is told why; the same message with no window known (the default) is sent, alone with
/// what the turn must send, and answered: the server decides.
pub async fn an_oversized_message_fails_only_against_a_known_window(stores: Stores) {
    let big = format!("please read {}", "word ".repeat(4_000));
    let llm = model(0);
    let mut h = build(config(""), stores, llm.clone(), vec![]).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", &big)).await.unwrap();
    let reply = h.reply().await;
    assert!(reply.is_failure(), "{reply:?}");
    assert!(
        reply
            .content
            .contains("more than the context window of 2000"),
        "{}",
        reply.content
    );
    assert!(llm.requests().is_empty(), "the model was not called");

    let stores = Stores::memory();
    seed(&stores, 50).await;
    let llm = model(0);
    let mut h = build(
        "[[agents]]\nid = \"a\"\n".into(),
        stores,
        llm.clone(),
        vec![],
    )
    .await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", &big)).await.unwrap();
    assert_eq!(h.reply().await.content, "answered");
    let requests: Vec<ChatRequest> = llm
        .requests()
        .into_iter()
        .filter(|r| !is_summary_request(r))
        .collect();
    assert_eq!(requests.len(), 1);
    assert_eq!(
        spacebot::testing::last_user_text(&requests[0].messages),
        big,
        "the message is sent whole"
    );
    assert!(
        !requests[0]
            .messages
            .iter()
            .any(|m| matches!(m, ChatMessage::User { content } if content.contains("old message"))),
        "no history goes with a message over the default window"
    );
}

/// The summary is stored: after a restart on the same stores the first request sends it and only
/// the records after it, with no new compaction.
pub async fn a_summary_survives_a_restart(stores: Stores) {
    seed(&stores, 500).await;
    let llm = model(0);
    let mut h = build(config(""), stores.clone(), llm.clone(), Vec::new()).await;
    h.org.start_all().await.unwrap();
    h.org.deliver("a", chat("a", "before")).await.unwrap();
    assert_eq!(h.reply().await.content, "answered");
    assert_eq!(
        llm.requests()
            .iter()
            .filter(|r| is_summary_request(r))
            .count(),
        1
    );
    h.org.shutdown().await.unwrap();
    drop(h);

    let key = format!("a/{}", portal("a"));
    let stored: Summary = stores
        .records
        .get(SUMMARY_NAMESPACE, &key)
        .await
        .unwrap()
        .expect("the summary is stored")
        .decode()
        .unwrap()
        .value;
    assert_eq!(stored.text, "SUMMARY 0");
    assert!(stored.through > 0 && stored.through <= 500, "{stored:?}");

    let llm2 = model(0);
    let mut h2 = build(config(""), stores, llm2.clone(), Vec::new()).await;
    h2.org.start_all().await.unwrap();
    h2.org.deliver("a", chat("a", "after")).await.unwrap();
    assert_eq!(h2.reply().await.content, "answered");
    let requests = llm2.requests();
    assert!(
        !requests.iter().any(is_summary_request),
        "no new compaction"
    );
    check_requests(&requests);
    let first = &requests[0];
    assert!(
        matches!(&first.messages[1], ChatMessage::System { content } if content.contains("SUMMARY 0")),
        "{:?}",
        first.messages[1]
    );
    // Record i has sequence number i + 1 (the channel was empty before the seed): none the
    // summary covers is sent again.
    for message in &first.messages {
        if let ChatMessage::User { content }
        | ChatMessage::Assistant {
            content: Some(content),
            ..
        } = message
            && let Some(n) = content
                .strip_prefix("old message ")
                .and_then(|t| t[..3].parse::<u64>().ok())
        {
            assert!(
                n + 1 > stored.through,
                "record {n} is covered by {stored:?}"
            );
        }
    }
}
