//! The A2A server mounted by the API: the card is public, JSON-RPC needs the API's token; a
//! remote A2A agent is marked remote in `GET /api/agents`, with its URL and never its token.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::sync::Arc;

use serde_json::{Value, json};
use spacebot_a2a::{A2a, A2aServer};
use spacebot_core::testing::{OrgHarness, ScriptedLlm};
use spacebot_http::{Api, HttpConfig, WebChat};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_mounts_the_a2a_server_behind_its_token() {
    let web = WebChat::new();
    let a2a = A2a::new().with_fallback(Arc::new(web.clone()));
    let h = OrgHarness::builder(
        "[[agents]]\nid = \"front\"\na2a_expose = true\n\
         [[agents]]\nid = \"far\"\na2a = \"http://127.0.0.1:9/far/\"\ntoken = \"remote-secret\"\n",
    )
    .llm(Arc::new(ScriptedLlm::new()))
    .behaviour(Arc::new(a2a.clone()))
    .outbound(Arc::new(a2a.clone()))
    .build()
    .await;
    let api = Api::new(h.org.clone(), web, HttpConfig::with_token("tok"))
        .unwrap()
        .with_a2a(A2aServer::new(h.org.clone(), a2a).unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = api.router();
    let served = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    let http = reqwest::Client::new();
    let card: Value = http
        .get(format!("http://{addr}/.well-known/agent-card.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(card["skills"][0]["id"], "front", "{card}");
    assert_eq!(
        card["supportedInterfaces"][0]["url"],
        format!("http://{addr}/a2a")
    );
    assert!(card["securitySchemes"]["bearer"].is_object(), "{card}");
    let body = json!({"jsonrpc": "2.0", "id": 7, "method": "GetTask", "params": {"id": "nope"}});
    let refused = http
        .post(format!("http://{addr}/a2a"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 401);
    let answered: Value = http
        .post(format!("http://{addr}/a2a"))
        .bearer_auth("tok")
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(answered["id"], 7);
    assert_eq!(answered["error"]["code"], -32001, "{answered}");

    // The dashboard's agents: far is remote, with its URL; its token is nowhere.
    let agents = http
        .get(format!("http://{addr}/api/agents"))
        .bearer_auth("tok")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(!agents.contains("remote-secret"), "{agents}");
    let agents: Value = serde_json::from_str(&agents).unwrap();
    let view = |id: &str| {
        agents
            .as_array()
            .unwrap()
            .iter()
            .find(|a| a["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("no agent {id} in {agents}"))
    };
    assert_eq!(view("far")["remote"], "http://127.0.0.1:9/far", "{agents}");
    assert!(view("front").get("remote").is_none(), "{agents}");
    served.abort();
}
