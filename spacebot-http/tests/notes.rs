//! The shared notes routes: list, one, history, compare-and-set writes (409 with the current
//! note), grants and revocations, bad input, and the routes without notes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use reqwest::Method;
use serde_json::json;

const NOTES_ORG: &str = r#"
[[agents]]
id = "chief"
[[agents]]
id = "lead"

[[notes]]
name = "plan"
description = "The plan"
text = "start"
readers = ["lead"]
writers = ["chief"]
"#;

async fn serve_notes() -> Server {
    serve_with(Options {
        toml: NOTES_ORG.to_string(),
        notes: true,
        ..Options::default()
    })
    .await
}

#[tokio::test]
async fn notes_are_listed_read_and_their_history_kept() {
    let s = serve_notes().await;
    let (status, body) = s.get("/api/notes").await;
    assert_eq!(status, 200);
    assert_eq!(
        body,
        json!([{
            "name": "plan", "description": "The plan", "version": 1, "text": "start",
            "author": "config", "written_at": body[0]["written_at"],
            "access": {"chief": "read_write", "lead": "read"}
        }])
    );
    assert!(body[0]["written_at"].as_i64().unwrap() > 0);

    let (status, note) = s.get("/api/notes/plan").await;
    assert_eq!((status, note["version"].as_u64()), (200, Some(1)));

    let (status, v2) = s
        .send(
            Method::PUT,
            "/api/notes/plan",
            Some(json!({"text": "ship Friday", "base_version": 1})),
        )
        .await;
    assert_eq!(status, 200, "{v2}");
    assert_eq!(
        (v2["version"].as_u64(), v2["author"].as_str()),
        (Some(2), Some("operator"))
    );

    let (status, history) = s.get("/api/notes/plan/history").await;
    assert_eq!(status, 200);
    let texts: Vec<_> = history
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["text"].as_str().unwrap())
        .collect();
    assert_eq!(texts, ["start", "ship Friday"]);

    // A new note: base_version absent means 0.
    let (status, created) = s
        .send(
            Method::PUT,
            "/api/notes/new-one",
            Some(json!({"text": "hello"})),
        )
        .await;
    assert_eq!((status, created["version"].as_u64()), (200, Some(1)));
}

#[tokio::test]
async fn a_write_based_on_an_old_version_is_409_with_the_current_note() {
    let s = serve_notes().await;
    let (status, _) = s
        .send(
            Method::PUT,
            "/api/notes/plan",
            Some(json!({"text": "a", "base_version": 1})),
        )
        .await;
    assert_eq!(status, 200);
    let (status, body) = s
        .send(
            Method::PUT,
            "/api/notes/plan",
            Some(json!({"text": "b", "base_version": 1})),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(
        error_of(&body),
        ("conflict".into(), Some("base_version".into()))
    );
    assert_eq!(body["current"]["version"], 2);
    assert_eq!(body["current"]["text"], "a");
    let (_, history) = s.get("/api/notes/plan/history").await;
    assert_eq!(
        history.as_array().unwrap().len(),
        2,
        "nothing written by the refused write"
    );
}

#[tokio::test]
async fn access_is_granted_and_revoked() {
    let s = serve_notes().await;
    let (status, body) = s
        .send(
            Method::PUT,
            "/api/notes/plan/access/lead",
            Some(json!({"access": "read_write"})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"name": "plan", "agent": "lead", "access": "read_write", "previous": "read"})
    );
    let (_, note) = s.get("/api/notes/plan").await;
    assert_eq!(note["access"]["lead"], "read_write");
    let notes = s.notes.as_ref().unwrap();
    assert_eq!(
        notes.access("plan").await.unwrap().get(&id("lead")),
        Some(&spacebot_notes::Access::ReadWrite)
    );

    let (status, body) = s
        .send(Method::DELETE, "/api/notes/plan/access/lead", None)
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        json!({"name": "plan", "agent": "lead", "previous": "read_write"})
    );
    let (_, note) = s.get("/api/notes/plan").await;
    assert!(note["access"].get("lead").is_none(), "{note}");
    // Revoking what is not there is not an error.
    let (status, body) = s
        .send(Method::DELETE, "/api/notes/plan/access/lead", None)
        .await;
    assert_eq!(status, 200);
    assert!(body.get("previous").is_none());
}

#[tokio::test]
async fn bad_input_is_refused_naming_the_field() {
    let s = serve_notes().await;
    let (status, body) = s.get("/api/notes/Not%20A%20Name").await;
    assert_eq!(
        (status, error_of(&body)),
        (400, ("invalid_input".into(), Some("name".into())))
    );
    let (status, body) = s.get("/api/notes/missing").await;
    assert_eq!(
        (status, error_of(&body)),
        (404, ("not_found".into(), Some("name".into())))
    );
    let (status, body) = s.get("/api/notes/missing/history").await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = s
        .send(Method::PUT, "/api/notes/plan", Some(json!({"txt": "typo"})))
        .await;
    assert_eq!(status, 400, "{body}");
    let big = "x".repeat(spacebot_notes::DEFAULT_MAX_TEXT + 1);
    let (status, body) = s
        .send(
            Method::PUT,
            "/api/notes/plan",
            Some(json!({"text": big, "base_version": 1})),
        )
        .await;
    assert_eq!(
        (status, error_of(&body)),
        (413, ("payload_too_large".into(), Some("text".into())))
    );
    let (status, body) = s
        .send(
            Method::PUT,
            "/api/notes/plan/access/ghost",
            Some(json!({"access": "read"})),
        )
        .await;
    assert_eq!(
        (status, error_of(&body)),
        (404, ("not_found".into(), Some("agent".into())))
    );
    let (status, body) = s
        .send(
            Method::PUT,
            "/api/notes/plan/access/lead",
            Some(json!({"access": "admin"})),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    let (status, _) = s
        .send(Method::POST, "/api/notes/plan", Some(json!({"text": "x"})))
        .await;
    assert_eq!(status, 405);
}

#[tokio::test]
async fn without_notes_the_routes_say_so() {
    let s = serve().await;
    let (status, body) = s.get("/api/notes").await;
    assert_eq!(status, 404);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not enabled"),
        "{body}"
    );
}
