//! The event stream: ids in order, reconnecting with Last-Event-ID, the replay window.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use serde_json::json;

async fn chat(s: &Server, agent: &str, text: &str) -> String {
    let (status, body) = s
        .post(
            &format!("/api/agents/{agent}/messages"),
            json!({"content": text}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    body["envelope_id"].as_str().unwrap().to_string()
}

fn is_reply_to(envelope: &str) -> impl Fn(&Sse) -> bool + '_ {
    move |e| e.event == "reply" && e.data["in_reply_to"][0] == envelope
}

/// Reads until `agent` answered `envelope` and went idle again: nothing more happens after that.
async fn until_settled(events: &mut Events, envelope: &str, agent: &str) -> Vec<Sse> {
    let mut seen = events.until(is_reply_to(envelope)).await;
    seen.extend(
        events
            .until(|e| {
                e.event == "org"
                    && e.data["agent"] == agent
                    && e.data["kind"]["type"] == "agent_idle"
            })
            .await,
    );
    seen
}

#[tokio::test]
async fn events_arrive_in_order_with_consecutive_ids() {
    let s = serve().await;
    let mut events = s.events(None).await;
    let mut envelopes = Vec::new();
    for text in ["one", "two", "three"] {
        envelopes.push(chat(&s, "lead", text).await);
    }
    let last = envelopes.last().unwrap().clone();
    let seen = events.until(is_reply_to(&last)).await;
    let ids: Vec<u64> = seen.iter().map(|e| e.id.unwrap()).collect();
    assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");
    // Organization events carry the serde form of spacebot_core::Event.
    let org: Vec<&Sse> = seen.iter().filter(|e| e.event == "org").collect();
    assert!(
        org.iter()
            .any(|e| e.data["kind"]["type"] == "turn_started" && e.data["agent"] == "lead"),
        "{seen:?}"
    );
    for e in &org {
        let _: spacebot_core::Event = serde_json::from_value(e.data.clone()).unwrap();
    }
    // The replies come in the order of the messages (steering may merge some into one reply).
    let replies: Vec<&Sse> = seen.iter().filter(|e| e.event == "reply").collect();
    let answered: Vec<String> = replies
        .iter()
        .flat_map(|r| {
            r.data["in_reply_to"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_str().unwrap().to_string())
        })
        .collect();
    assert_eq!(answered, envelopes);
}

#[tokio::test]
async fn a_client_that_reconnects_gets_what_it_missed() {
    let s = serve().await;
    let mut first = s.events(None).await;
    let envelope = chat(&s, "lead", "before").await;
    let seen = until_settled(&mut first, &envelope, "lead").await;
    let last_seen = seen.last().unwrap().id.unwrap();
    drop(first);

    // While disconnected: more events. A second client watches them to know when they are done.
    let mut watcher = s.events(None).await;
    let envelope = chat(&s, "cm", "while away").await;
    let missed = until_settled(&mut watcher, &envelope, "cm").await;
    assert_eq!(missed[0].id, Some(last_seen + 1), "{missed:?}");

    let mut again = s.events(Some(last_seen)).await;
    let mut replayed = Vec::new();
    for _ in 0..missed.len() {
        replayed.push(again.next().await);
    }
    let ids: Vec<Option<u64>> = replayed.iter().map(|e| e.id).collect();
    let expected: Vec<Option<u64>> = (1..=missed.len() as u64)
        .map(|i| Some(last_seen + i))
        .collect();
    assert_eq!(ids, expected);
    assert_eq!(
        replayed
            .iter()
            .map(|e| (&e.event, &e.data))
            .collect::<Vec<_>>(),
        missed
            .iter()
            .map(|e| (&e.event, &e.data))
            .collect::<Vec<_>>()
    );
    // Then live events continue after the replay.
    let envelope = chat(&s, "lead", "after").await;
    let live = again.until(is_reply_to(&envelope)).await;
    assert_eq!(live[0].id, Some(last_seen + missed.len() as u64 + 1));
}

#[tokio::test]
async fn a_client_beyond_the_replay_window_is_told_how_many_it_missed() {
    // A window that holds one exchange (about five events) but not three.
    let window = 8;
    let s = serve_with(Options {
        replay_window: window,
        ..Options::default()
    })
    .await;
    let mut first = s.events(None).await;
    let envelope = chat(&s, "lead", "before").await;
    let last_seen = until_settled(&mut first, &envelope, "lead")
        .await
        .last()
        .unwrap()
        .id
        .unwrap();
    drop(first);

    let mut watcher = s.events(None).await;
    let mut happened = Vec::new();
    for text in ["away 1", "away 2", "away 3"] {
        let envelope = chat(&s, "cm", text).await;
        happened.extend(until_settled(&mut watcher, &envelope, "cm").await);
    }
    assert!(happened.len() > window, "{happened:?}");
    let newest = happened.last().unwrap().id.unwrap();

    let mut again = s.events(Some(last_seen)).await;
    let notice = again.next().await;
    assert_eq!(notice.event, "missed");
    assert_eq!(notice.id, None);
    assert_eq!(
        notice.data["missed"],
        json!(newest - last_seen - window as u64)
    );
    let mut kept = Vec::new();
    for _ in 0..window {
        kept.push(again.next().await.id.unwrap());
    }
    assert_eq!(
        kept,
        (newest - window as u64 + 1..=newest).collect::<Vec<_>>()
    );

    // The query parameter works like the header; a bad header is a 400 naming it.
    let r = s
        .http
        .get(s.url("/api/events"))
        .bearer_auth(TOKEN)
        .header("Last-Event-ID", "yesterday")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(error_of(&body).1.as_deref(), Some("Last-Event-ID"));
    let r = s
        .http
        .get(s.url("/api/events?last_event_id=x"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    // The alias at /events serves the same stream.
    let r = s
        .http
        .get(s.url(&format!("/events?access_token={TOKEN}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn an_id_from_an_earlier_run_replays_the_whole_window() {
    let s = serve().await;
    let mut watcher = s.events(None).await;
    let envelope = chat(&s, "lead", "hello").await;
    let happened = until_settled(&mut watcher, &envelope, "lead").await;
    let newest = happened.last().and_then(|e| e.id).unwrap();
    // An id this run never gave: the whole window, from the run's first event (the agents'
    // start-up came before the watcher connected), through what the watcher saw.
    let mut again = s.events(Some(10_000)).await;
    let mut replayed = Vec::new();
    while replayed.last().and_then(|e: &Sse| e.id) != Some(newest) {
        replayed.push(again.next().await);
    }
    assert_eq!(replayed[0].id, Some(1), "the whole window");
    let ids: Vec<u64> = replayed.iter().filter_map(|e| e.id).collect();
    assert!(ids.windows(2).all(|w| w[1] == w[0] + 1), "{ids:?}");
    let tail = &replayed[replayed.len() - happened.len()..];
    for (replayed, e) in tail.iter().zip(&happened) {
        assert_eq!(
            (replayed.id, &replayed.event, &replayed.data),
            (e.id, &e.event, &e.data)
        );
    }
}
