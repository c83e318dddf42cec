//! Graceful shutdown with event-stream clients connected: the streams end, so the server stops.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use spacebot_core::llm::ChatResponse;
use spacebot_core::testing::ScriptedLlm;
use spacebot_core::{OrgConfig, Organization, Stores};
use spacebot_http::{Api, HttpConfig, WebChat};

const ORG: &str = "[[agents]]\nid = \"a\"\nname = \"Alpha\"\n";

#[tokio::test]
async fn graceful_shutdown_ends_the_event_streams_and_the_server_stops() {
    let llm = ScriptedLlm::new().with_fallback(|_| Ok(ChatResponse::text("ok")));
    let chat = WebChat::new();
    let org = Organization::builder(OrgConfig::from_toml_str(ORG).unwrap())
        .stores(Stores::memory())
        .llm(Arc::new(llm))
        .outbound(Arc::new(chat.clone()))
        .build()
        .await
        .unwrap();
    org.start_all().await.unwrap();
    let api = Api::new(org.clone(), chat, HttpConfig::insecure_no_auth()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let app = api.router();
    let signal = api.graceful_shutdown(async {
        let _ = stop_rx.await;
    });
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(signal)
            .await
    });
    let http = reqwest::Client::new();
    let mut streams = Vec::new();
    for _ in 0..2 {
        let r = http.get(format!("{base}/api/events")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        streams.push(r.bytes_stream());
    }
    // A message and its reply go through the open streams first.
    let r = http
        .post(format!("{base}/api/agents/a/messages"))
        .json(&serde_json::json!({"content": "hi"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);
    let first = tokio::time::timeout(Duration::from_secs(10), streams[0].next())
        .await
        .expect("an event within 10 s");
    assert!(matches!(first, Some(Ok(_))));
    assert!(!api.is_shut_down());

    stop.send(()).unwrap();
    for mut stream in streams {
        tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(Ok(_)) = stream.next().await {}
        })
        .await
        .expect("the event stream did not end");
    }
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("the server did not stop within 10 s")
        .unwrap()
        .unwrap();
    assert!(api.is_shut_down());
    org.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_stream_opened_after_shutdown_ends_at_once() {
    let llm = ScriptedLlm::new();
    let chat = WebChat::new();
    let org = Organization::builder(OrgConfig::from_toml_str(ORG).unwrap())
        .stores(Stores::memory())
        .llm(Arc::new(llm))
        .outbound(Arc::new(chat.clone()))
        .build()
        .await
        .unwrap();
    let api = Api::new(org, chat, HttpConfig::insecure_no_auth()).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let app = api.router();
    let _server = tokio::spawn(async move { axum::serve(listener, app).await });
    api.shutdown();
    let body = tokio::time::timeout(
        Duration::from_secs(10),
        reqwest::get(format!("{base}/api/events"))
            .await
            .unwrap()
            .text(),
    )
    .await
    .expect("the stream did not end")
    .unwrap();
    assert_eq!(body, "");
}
