//! Every endpoint of the router: status codes, bodies, auth and bad input.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use reqwest::Method;
use serde_json::json;
use spacebot_http::HttpConfig;

#[tokio::test]
async fn the_api_needs_the_bearer_token() {
    let s = serve().await;
    let r = s.http.get(s.url("/api/agents")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        error_of(&body),
        ("unauthorized".into(), Some("Authorization".into()))
    );

    let r = s
        .http
        .get(s.url("/api/agents"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = s
        .http
        .get(s.url("/api/events?access_token=wrong"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    // The token in the query only counts on the event stream.
    let r = s
        .http
        .get(s.url(&format!("/api/agents?access_token={TOKEN}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = s
        .http
        .get(s.url(&format!("/api/events?access_token={TOKEN}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);

    let (status, body) = s.get("/api/health").await;
    assert_eq!((status, body["status"].as_str()), (200, Some("ok")));
    assert_eq!(body["agents"], 3);

    // The dashboard and the OpenAPI description are public.
    let r = s.http.get(s.url("/")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/html")
    );
    assert!(r.text().await.unwrap().contains("spacebot"));
    for asset in [
        "/assets/app.js",
        "/assets/app.css",
        "/assets/vendor/cytoscape.min.js",
        "/assets/vendor/cytoscape.LICENSE",
    ] {
        let r = s.http.get(s.url(asset)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{asset}");
    }
    let r = s.http.get(s.url("/api/openapi.json")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn insecure_no_auth_opts_out() {
    let s = serve_with(Options {
        http: HttpConfig::insecure_no_auth(),
        ..Options::default()
    })
    .await;
    let r = s.http.get(s.url("/api/agents")).send().await.unwrap();
    assert_eq!(r.status(), 200);
}

#[tokio::test]
async fn an_empty_token_is_refused() {
    let chat = spacebot_http::WebChat::new();
    let config = spacebot_core::OrgConfig::from_toml_str(ORG).unwrap();
    let org = spacebot_core::Organization::builder(config)
        .stores(spacebot_core::Stores::memory())
        .llm(std::sync::Arc::new(
            spacebot_core::testing::ScriptedLlm::new(),
        ))
        .build()
        .await
        .unwrap();
    let err = spacebot_http::Api::new(org, chat, HttpConfig::with_token("")).unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");
}

#[tokio::test]
async fn unknown_endpoints_are_json_404() {
    let s = serve().await;
    let (status, body) = s.get("/api/nope").await;
    assert_eq!(status, 404);
    assert_eq!(error_of(&body).0, "not_found");
    let (status, body) = s.send(Method::PUT, "/api/agents", None).await;
    assert_eq!(
        (status, error_of(&body).0.as_str()),
        (405, "method_not_allowed")
    );
    // A path segment that is not UTF-8, and a body too large: 4xx in the same shape.
    let (status, body) = s.get("/api/agents/%FF").await;
    assert_eq!((status, error_of(&body).1.as_deref()), (400, Some("path")));
    let big = "x".repeat(3 * 1024 * 1024);
    let (status, body) = s
        .post("/api/agents/lead/messages", json!({"content": big}))
        .await;
    assert_eq!(
        (status, error_of(&body).0.as_str()),
        (413, "payload_too_large")
    );
}

#[tokio::test]
async fn agents_list_status_start_and_stop() {
    let s = serve().await;
    for a in ["chief", "lead", "cm"] {
        s.org.wait_idle(&id(a)).await.unwrap();
    }
    let (status, body) = s.get("/api/agents").await;
    assert_eq!(status, 200);
    let ids: Vec<&str> = body
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["chief", "cm", "lead"]);
    assert!(
        body.as_array()
            .unwrap()
            .iter()
            .all(|a| a["status"] == "idle"),
        "{body}"
    );
    assert_eq!(body[2]["name"], "Tech Lead");

    let (status, body) = s.send(Method::POST, "/api/agents/cm/stop", None).await;
    assert_eq!((status, body["status"].as_str()), (200, Some("stopped")));
    let (_, body) = s.get("/api/agents/cm").await;
    assert_eq!(body["status"], "stopped");
    let (status, body) = s.send(Method::POST, "/api/agents/cm/start", None).await;
    assert_eq!(status, 200);
    assert_ne!(body["status"], "stopped");

    let (status, body) = s.get("/api/agents/ghost").await;
    assert_eq!(status, 404);
    assert_eq!(error_of(&body), ("not_found".into(), Some("agent".into())));
    let (status, body) = s.get("/api/agents/bad%20id").await;
    assert_eq!(status, 400);
    assert_eq!(
        error_of(&body),
        ("invalid_input".into(), Some("agent".into()))
    );
    let (status, _) = s.send(Method::POST, "/api/agents/ghost/start", None).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn links_crud_and_validation() {
    let s = serve().await;
    let (status, body) = s.get("/api/links").await;
    assert_eq!(status, 200);
    assert_eq!(body.as_array().unwrap().len(), 2);

    let (status, body) = s
        .post(
            "/api/links",
            json!({"from": "lead", "to": "cm", "direction": "one_way", "relationship": "superior"}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["from"], "lead");
    assert_eq!(body["direction"], "one_way");
    assert_eq!(body["enabled"], true);
    assert_eq!(body["channels"], json!(["link:lead:cm", "link:cm:lead"]));
    let link = body["id"].as_str().unwrap().to_string();
    // It takes effect at once.
    assert!(s.org.link(&id("lead"), &id("cm")).is_some());

    let (status, body) = s.get(&format!("/api/links/{link}")).await;
    assert_eq!((status, body["to"].as_str()), (200, Some("cm")));
    let (_, body) = s.get("/api/agents/cm/links").await;
    assert_eq!(body.as_array().unwrap().len(), 2);

    let (status, body) = s
        .patch(
            &format!("/api/links/{link}"),
            json!({"relationship": "peer", "direction": "two_way"}),
        )
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        (body["relationship"].as_str(), body["direction"].as_str()),
        (Some("peer"), Some("two_way"))
    );

    // Bad input: each names its field.
    let cases = [
        (
            json!({"from": "lead", "to": "cm", "direction": "sideways"}),
            400,
            "invalid_input",
            "direction",
        ),
        (json!({"from": "lead"}), 400, "invalid_input", "to"),
        (
            json!({"from": "lead", "to": "lead"}),
            400,
            "invalid_input",
            "to",
        ),
        (
            json!({"from": "ghost", "to": "lead"}),
            404,
            "not_found",
            "from",
        ),
        (
            json!({"from": "bad id", "to": "lead"}),
            400,
            "invalid_input",
            "from",
        ),
        (
            json!({"from": "cm", "to": "lead", "colour": "red"}),
            400,
            "invalid_input",
            "colour",
        ),
        (
            json!({"from": "cm", "to": "lead", "enabled": "yes"}),
            400,
            "invalid_input",
            "enabled",
        ),
        (
            json!({"from": "cm", "to": "lead", "relationship": 3}),
            400,
            "invalid_input",
            "relationship",
        ),
        (json!({"from": "chief", "to": "cm"}), 409, "conflict", "to"),
        (json!({"from": "cm", "to": "chief"}), 409, "conflict", "to"),
    ];
    for (body, status, code, field) in cases {
        let (got, answer) = s.post("/api/links", body.clone()).await;
        assert_eq!(got, status, "{body} -> {answer}");
        if status >= 400 {
            let (c, f) = error_of(&answer);
            assert_eq!(c, code, "{body} -> {answer}");
            assert!(
                f.as_deref().is_some_and(|f| f.contains(field)),
                "{body} -> {answer}"
            );
        }
    }
    let (status, answer) = s
        .patch(&format!("/api/links/{link}"), json!({"enabled": 1}))
        .await;
    assert_eq!(
        (status, error_of(&answer).1.as_deref()),
        (400, Some("enabled"))
    );
    // Not JSON at all.
    let r = s
        .http
        .post(s.url("/api/links"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body("{nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = s
        .http
        .post(s.url("/api/links"))
        .bearer_auth(TOKEN)
        .body("from=a")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(error_of(&body).0, "unsupported_media_type");

    let (status, body) = s
        .send(Method::DELETE, &format!("/api/links/{link}"), None)
        .await;
    assert_eq!((status, body), (204, serde_json::Value::Null));
    assert!(s.org.link(&id("lead"), &id("cm")).is_none());
    let (status, body) = s
        .send(Method::DELETE, &format!("/api/links/{link}"), None)
        .await;
    assert_eq!(
        (status, error_of(&body)),
        (404, ("not_found".into(), Some("link".into())))
    );
    let (status, _) = s.patch("/api/links/nope", json!({"enabled": false})).await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn a_disabled_link_refuses_a_delegation_right_after_the_patch() {
    let s = serve().await;
    let link = s.link_id("chief", "lead").await;
    let (status, body) = s
        .patch(&format!("/api/links/{link}"), json!({"enabled": false}))
        .await;
    assert_eq!((status, body["enabled"].as_bool()), (200, Some(false)));

    let (status, body) = s
        .post(
            "/api/agents/chief/delegate",
            json!({"target": "lead", "message": "write the report"}),
        )
        .await;
    assert_eq!(status, 403, "{body}");
    assert_eq!(error_of(&body).0, "policy_denied");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("disabled"),
        "{body}"
    );
    // The policy itself agrees, on the organization's own API.
    let err = s
        .org
        .delegate(
            &id("chief"),
            "lead",
            "x",
            spacebot_core::delegation::DelegationOrigin::new(spacebot_core::ChannelId::new(
                "web:t",
            )),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("disabled"), "{err}");

    let (status, _) = s
        .patch(&format!("/api/links/{link}"), json!({"enabled": true}))
        .await;
    assert_eq!(status, 200);
    let (status, body) = s
        .post(
            "/api/agents/chief/delegate",
            json!({"target": "lead", "message": "write the report"}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    assert_eq!(body["agent"], "lead");
    assert_eq!(body["reference"], "lead#1");
    assert_eq!(body["delegated_by"], "chief");

    let (status, body) = s
        .post(
            "/api/agents/chief/delegate",
            json!({"target": "ghost", "message": "x"}),
        )
        .await;
    assert_eq!(
        (status, error_of(&body).1.as_deref()),
        (404, Some("target"))
    );
    let (status, body) = s
        .post(
            "/api/agents/chief/delegate",
            json!({"target": "lead", "message": "  "}),
        )
        .await;
    assert_eq!(
        (status, error_of(&body).1.as_deref()),
        (400, Some("message"))
    );
    let (status, body) = s
        .post("/api/agents/chief/delegate", json!({"message": "x"}))
        .await;
    assert_eq!(
        (status, error_of(&body).1.as_deref()),
        (400, Some("target"))
    );
}

#[tokio::test]
async fn tasks_filter_approve_reject_cancel() {
    let s = serve().await;
    // chief -> cm is a peer link: with approval unless_superior, tasks wait for approval.
    for message in ["one", "two", "three"] {
        let (status, body) = s
            .post(
                "/api/agents/chief/delegate",
                json!({"target": "cm", "message": message}),
            )
            .await;
        assert_eq!(
            (status, body["status"].as_str()),
            (201, Some("pending_approval")),
            "{body}"
        );
    }
    let (status, body) = s.get("/api/agents/cm/tasks?status=pending_approval").await;
    assert_eq!(status, 200);
    assert_eq!(body.as_array().unwrap().len(), 3);
    let (_, body) = s.get("/api/agents/cm/tasks?status=done,failed").await;
    assert_eq!(body, json!([]));
    let (_, body) = s.get("/api/agents/cm/tasks?limit=1").await;
    assert_eq!(body.as_array().unwrap().len(), 1);

    let (status, body) = s.get("/api/agents/cm/tasks/2").await;
    assert_eq!((status, body["description"].as_str()), (200, Some("two")));

    let (status, body) = s
        .send(Method::POST, "/api/agents/cm/tasks/1/approve", None)
        .await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("ready")),
        "{body}"
    );
    // The approved task runs and ends (the scripted model answers).
    let task = spacebot_core::TaskRef::new(id("cm"), 1);
    let done = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        s.org.wait_task_ended(&task),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(done.status, spacebot_core::TaskStatus::Done);
    let (_, body) = s.get("/api/agents/cm/tasks?status=done").await;
    assert_eq!(body[0]["result"], "cm says ok");

    let (status, body) = s
        .post(
            "/api/agents/cm/tasks/2/reject",
            json!({"reason": "not now"}),
        )
        .await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("cancelled")),
        "{body}"
    );
    let (status, body) = s
        .send(Method::POST, "/api/agents/cm/tasks/3/cancel", None)
        .await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("cancelled")),
        "{body}"
    );
    // Ended tasks cannot be approved, rejected or cancelled again.
    let (status, body) = s
        .send(Method::POST, "/api/agents/cm/tasks/3/approve", None)
        .await;
    assert_eq!(
        (status, error_of(&body).0.as_str()),
        (409, "conflict"),
        "{body}"
    );
    let (status, body) = s.post("/api/agents/cm/tasks/1/reject", json!({})).await;
    assert_eq!(status, 400, "{body}");

    let cases = [
        ("/api/agents/cm/tasks?status=sleeping", 400, "status"),
        ("/api/agents/cm/tasks?limit=many", 400, "limit"),
        ("/api/agents/cm/tasks?colour=red", 400, "colour"),
        ("/api/agents/cm/tasks/x", 400, "number"),
        ("/api/agents/cm/tasks/0", 400, "number"),
        ("/api/agents/cm/tasks/99", 404, "number"),
        ("/api/agents/ghost/tasks", 404, "agent"),
    ];
    for (path, status, field) in cases {
        let (got, body) = s.get(path).await;
        assert_eq!(got, status, "{path}: {body}");
        assert_eq!(error_of(&body).1.as_deref(), Some(field), "{path}: {body}");
    }
    let (status, body) = s
        .send(Method::POST, "/api/agents/cm/tasks/99/cancel", None)
        .await;
    assert_eq!(
        (status, error_of(&body).1.as_deref()),
        (404, Some("number"))
    );
    let (status, body) = s
        .post("/api/agents/cm/tasks/2/cancel", json!({"reason": 5}))
        .await;
    assert_eq!(
        (status, error_of(&body).1.as_deref()),
        (400, Some("reason"))
    );
}

#[tokio::test]
async fn channels_history_and_link_timeline() {
    let s = serve().await;
    let (status, body) = s
        .post(
            "/api/agents/chief/delegate",
            json!({"target": "lead", "message": "ship it"}),
        )
        .await;
    assert_eq!(status, 201, "{body}");
    let task = spacebot_core::TaskRef::new(id("lead"), 1);
    tokio::time::timeout(
        std::time::Duration::from_secs(10),
        s.org.wait_task_ended(&task),
    )
    .await
    .unwrap()
    .unwrap();

    let (status, body) = s.get("/api/agents/chief/channels").await;
    assert_eq!(status, 200);
    let channels: Vec<&str> = body
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap())
        .collect();
    assert!(channels.contains(&"link:chief:lead"), "{body}");

    let (status, body) = s.get("/api/agents/lead/channels/link:lead:chief").await;
    assert_eq!(status, 200);
    assert!(!body.as_array().unwrap().is_empty(), "{body}");
    assert!(
        body.as_array()
            .unwrap()
            .iter()
            .any(|r| r["content"].as_str().unwrap().contains("ship it")),
        "{body}"
    );
    let (_, limited) = s
        .get("/api/agents/lead/channels/link:lead:chief?limit=1")
        .await;
    assert_eq!(limited.as_array().unwrap().len(), 1);
    let (_, empty) = s.get("/api/agents/lead/channels/nothing-here").await;
    assert_eq!(empty, json!([]));

    let link = s.link_id("chief", "lead").await;
    let (status, body) = s.get(&format!("/api/links/{link}/timeline")).await;
    assert_eq!(status, 200);
    let records = body["records"].as_array().unwrap();
    assert!(records.len() >= 2, "{body}");
    let agents: std::collections::HashSet<&str> = records
        .iter()
        .map(|r| r["agent"].as_str().unwrap())
        .collect();
    assert!(
        agents.contains("chief") && agents.contains("lead"),
        "{body}"
    );
    let times: Vec<i64> = records.iter().map(|r| r["at"].as_i64().unwrap()).collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");

    let (status, body) = s.get("/api/agents/lead/channels/x?limit=-1").await;
    assert_eq!((status, error_of(&body).1.as_deref()), (400, Some("limit")));
    let (status, _) = s.get("/api/links/nope/timeline").await;
    assert_eq!(status, 404);
    let (status, _) = s.get("/api/agents/ghost/channels").await;
    assert_eq!(status, 404);
}

#[tokio::test]
async fn topology_as_json_dot_and_mermaid() {
    let s = serve().await;
    let (status, body) = s.get("/api/topology").await;
    assert_eq!(status, 200);
    assert_eq!(body["agents"][0], json!({"id": "chief", "name": "Chief"}));
    let link = &body["links"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["to"] == "lead")
        .unwrap();
    assert_eq!(
        (
            link["direction"].as_str(),
            link["relationship"].as_str(),
            link["enabled"].as_bool()
        ),
        (Some("two_way"), Some("superior"), Some(true))
    );
    let (status, dot) = s.get_text("/api/topology?format=dot").await;
    assert_eq!(status, 200);
    assert!(dot.starts_with("digraph"), "{dot}");
    assert!(dot.contains("\"chief\" -> \"lead\""), "{dot}");
    let (status, mermaid) = s.get_text("/api/topology?format=mermaid").await;
    assert_eq!(status, 200);
    assert!(mermaid.starts_with("flowchart"), "{mermaid}");
    let (status, body) = s.get("/api/topology?format=png").await;
    assert_eq!(
        (status, error_of(&body).1.as_deref()),
        (400, Some("format"))
    );
}

#[tokio::test]
async fn conversations_list_get_and_sever() {
    let s = serve().await;
    let (status, body) = s.get("/api/conversations").await;
    assert_eq!((status, body), (200, json!([])));
    // The lead is stopped: the chief's message waits for it, and the conversation stays open.
    s.org.stop_agent(&id("lead")).await.unwrap();
    s.llm.push_tool_call(
        &id("chief"),
        "send_link_message",
        json!({"target": "lead", "message": "let us talk"}),
    );
    s.llm.push_text(&id("chief"), "asked the lead");
    let (status, _) = s
        .post(
            "/api/agents/chief/messages",
            json!({"content": "talk to the lead"}),
        )
        .await;
    assert_eq!(status, 202);
    let list = s
        .get_until("/api/conversations?status=open", |l| {
            l.as_array().is_some_and(|l| l.len() == 1)
        })
        .await;
    let conversation = list[0]["id"].as_str().unwrap().to_string();
    assert_eq!(list[0]["initiator"], "chief");
    assert_eq!(list[0]["mode"], "mirrored");
    let (_, by_member) = s.get("/api/conversations?member=lead").await;
    assert_eq!(by_member.as_array().unwrap().len(), 1);
    let (_, by_other) = s.get("/api/conversations?member=cm").await;
    assert_eq!(by_other, json!([]));

    let (status, body) = s.get(&format!("/api/conversations/{conversation}")).await;
    assert_eq!((status, body["status"].as_str()), (200, Some("open")));
    let (status, body) = s
        .post(
            &format!("/api/conversations/{conversation}/sever"),
            json!({"reason": "enough"}),
        )
        .await;
    assert_eq!(
        (status, body["status"].as_str()),
        (200, Some("severed")),
        "{body}"
    );
    assert!(
        body["members"]
            .as_array()
            .unwrap()
            .iter()
            .all(|m| m["open"] == false)
    );

    let (status, body) = s.get("/api/conversations/nope").await;
    assert_eq!(
        (status, error_of(&body).1.as_deref()),
        (404, Some("conversation"))
    );
    let (status, _) = s
        .send(Method::POST, "/api/conversations/nope/sever", None)
        .await;
    assert_eq!(status, 404);
    let (status, body) = s.get("/api/conversations?status=maybe").await;
    assert_eq!(
        (status, error_of(&body).1.as_deref()),
        (400, Some("status"))
    );
    let (status, body) = s.get("/api/conversations?member=bad%20id").await;
    assert_eq!(
        (status, error_of(&body).1.as_deref()),
        (400, Some("member"))
    );
}

#[tokio::test]
async fn chat_messages_are_answered_on_the_event_stream() {
    let s = serve().await;
    let mut events = s.events(None).await;
    let (status, body) = s
        .post(
            "/api/agents/Tech%20Lead/messages",
            json!({"content": "hello", "chat_id": "c1"}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["agent"], "lead");
    assert_eq!(body["channel"], "web:c1");
    let envelope = body["envelope_id"].as_str().unwrap().to_string();
    let seen = events.until(|e| e.event == "reply").await;
    let reply = &seen.last().unwrap().data;
    assert_eq!(reply["content"], "lead says ok");
    assert_eq!(reply["in_reply_to"], json!([envelope]));
    assert_eq!(reply["source"]["reply_target"], "c1");

    let cases = [
        (
            "/api/agents/lead/messages",
            json!({"content": " "}),
            400,
            "content",
        ),
        ("/api/agents/lead/messages", json!({}), 400, "content"),
        (
            "/api/agents/lead/messages",
            json!({"content": "x", "chat_id": ""}),
            400,
            "chat_id",
        ),
        (
            "/api/agents/lead/messages",
            json!({"content": "x", "idempotency_key": ""}),
            400,
            "idempotency_key",
        ),
        (
            "/api/agents/ghost/messages",
            json!({"content": "x"}),
            404,
            "agent",
        ),
    ];
    for (path, body, status, field) in cases {
        let (got, answer) = s.post(path, body.clone()).await;
        assert_eq!(got, status, "{body}: {answer}");
        assert_eq!(
            error_of(&answer).1.as_deref(),
            Some(field),
            "{body}: {answer}"
        );
    }
}

#[tokio::test]
async fn a_chat_message_posted_again_with_its_key_is_answered_once() {
    let s = serve().await;
    let mut events = s.events(None).await;
    let post = |body: serde_json::Value| {
        let s = &s;
        async move {
            let (status, answer) = s.post("/api/agents/lead/messages", body).await;
            assert_eq!(status, 202, "{answer}");
            answer["envelope_id"].as_str().unwrap().to_string()
        }
    };
    let first = post(json!({"content": "hello", "idempotency_key": "m-1"})).await;
    let again = post(json!({"content": "hello", "idempotency_key": "m-1"})).await;
    let other = post(json!({"content": "and this"})).await;
    // The lead takes its messages in order: once the last one is answered, the repeat was handled.
    let seen = events
        .until(|e| e.event == "reply" && e.data["in_reply_to"] == json!([other]))
        .await;
    let answered: Vec<&serde_json::Value> = seen
        .iter()
        .filter(|e| e.event == "reply")
        .map(|e| &e.data["in_reply_to"])
        .collect();
    assert_eq!(
        answered,
        vec![&json!([first]), &json!([other])],
        "not {again}"
    );
}

#[tokio::test]
async fn a_task_shows_its_trace_id_and_links_to_its_trace() {
    let s = serve_with(Options {
        http: HttpConfig::with_token(TOKEN)
            .with_trace_url("http://localhost:16686/trace/{trace_id}"),
        ..Options::default()
    })
    .await;
    let tasks = &s.org.stores().tasks;
    let mut traced = spacebot_core::NewTask::new("traced", "with a stored trace context");
    traced.status = spacebot_core::TaskStatus::Backlog;
    traced.metadata.trace_context =
        Some("00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01\nvendor=x".into());
    let mut untraced = spacebot_core::NewTask::new("untraced", "no trace context");
    untraced.status = spacebot_core::TaskStatus::Backlog;
    let mut zero = spacebot_core::NewTask::new("zero", "an invalid context");
    zero.status = spacebot_core::TaskStatus::Backlog;
    zero.metadata.trace_context =
        Some("00-00000000000000000000000000000000-00f067aa0ba902b7-01".into());
    for task in [traced, untraced, zero] {
        tasks
            .create(&id("cm"), task, spacebot_core::Timestamp(0))
            .await
            .unwrap();
    }
    let (status, body) = s.get("/api/agents/cm/tasks/1").await;
    assert_eq!(status, 200);
    assert_eq!(body["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(
        body["trace_url"],
        "http://localhost:16686/trace/4bf92f3577b34da6a3ce929d0e0e4736"
    );
    let (_, board) = s.get("/api/agents/cm/tasks").await;
    assert_eq!(board[0]["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    for untraced in [&board[1], &board[2]] {
        assert!(untraced.get("trace_id").is_none(), "{untraced}");
        assert!(untraced.get("trace_url").is_none(), "{untraced}");
    }

    // Without a template: the id, no link.
    let plain = serve().await;
    let mut traced = spacebot_core::NewTask::new("traced", "with a stored trace context");
    traced.status = spacebot_core::TaskStatus::Backlog;
    traced.metadata.trace_context =
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".into());
    plain
        .org
        .stores()
        .tasks
        .create(&id("cm"), traced, spacebot_core::Timestamp(0))
        .await
        .unwrap();
    let (_, body) = plain.get("/api/agents/cm/tasks/1").await;
    assert_eq!(body["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert!(body.get("trace_url").is_none(), "{body}");
}

#[tokio::test]
async fn a_trace_url_template_needs_the_trace_id() {
    let org =
        spacebot_core::Organization::builder(spacebot_core::OrgConfig::from_toml_str(ORG).unwrap())
            .stores(spacebot_core::Stores::memory())
            .llm(std::sync::Arc::new(
                spacebot_core::testing::ScriptedLlm::new(),
            ))
            .build()
            .await
            .unwrap();
    let config = HttpConfig::with_token(TOKEN).with_trace_url("http://localhost:16686/trace/");
    let err = spacebot_http::Api::new(org, spacebot_http::WebChat::new(), config).unwrap_err();
    assert!(
        matches!(err, spacebot_http::HttpError::InvalidTraceUrl(_)),
        "{err}"
    );
}

#[tokio::test]
async fn period_limits_set_and_cleared_at_run_time() {
    let s = serve().await;
    let (status, body) = s
        .send(
            reqwest::Method::PUT,
            "/api/agents/lead/limits/hour",
            Some(json!({"model_calls": 1})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body[0]["period"], "hour");
    assert_eq!(body[0]["limits"]["model_calls"], 1);
    let (_, spend) = s.get("/api/agents/lead/spend").await;
    assert_eq!(spend, body, "the spend view shows the operator's limit");

    // One call fits in the hour; the next message is refused, saying why.
    let mut events = s.events(None).await;
    let (status, _) = s
        .post(
            "/api/agents/lead/messages",
            json!({"content": "one", "chat_id": "c1"}),
        )
        .await;
    assert_eq!(status, 202);
    let seen = events.until(|e| e.event == "reply").await;
    assert_eq!(seen.last().unwrap().data["content"], "lead says ok");
    s.post(
        "/api/agents/lead/messages",
        json!({"content": "two", "chat_id": "c1"}),
    )
    .await;
    let seen = events.until(|e| e.event == "reply").await;
    let refused = &seen.last().unwrap().data;
    assert!(
        refused["content"]
            .as_str()
            .is_some_and(|c| c.contains("agent lead (last hour)")),
        "{refused}"
    );

    let (status, body) = s
        .send(
            reqwest::Method::DELETE,
            "/api/agents/lead/limits/hour",
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!([]), "cleared: nothing limits the agent's hour");

    let (status, body) = s
        .send(
            reqwest::Method::PUT,
            "/api/limits/day",
            Some(json!({"total_tokens": 100000})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body[0]["period"], "day");
    assert_eq!(body[0]["limits"]["total_tokens"], 100000);

    for (method, path, status, field) in [
        (reqwest::Method::PUT, "/api/limits/week", 400, "period"),
        (
            reqwest::Method::PUT,
            "/api/agents/ghost/limits/hour",
            404,
            "agent",
        ),
    ] {
        let (got, answer) = s.send(method, path, Some(json!({"model_calls": 1}))).await;
        assert_eq!(got, status, "{path}: {answer}");
        assert_eq!(error_of(&answer).1.as_deref(), Some(field), "{answer}");
    }
}

/// A conversation opened within a request hangs in its tree under the turn that opened it, and
/// the other member's turns in it hang under the conversation.
#[tokio::test]
async fn a_conversation_appears_in_the_request_tree_with_its_members_turns() {
    let llm = spacebot_core::testing::ScriptedLlm::new().with_fallback(|request| {
        let agent = request.agent.as_ref().map_or("?", |a| a.as_str());
        Ok(spacebot_core::llm::ChatResponse::text(format!(
            "{agent} says ok"
        )))
    });
    llm.push_tool_call(
        &id("chief"),
        "send_link_message",
        json!({"target": "lead", "message": "how is the release?"}),
    );
    llm.push_text(&id("chief"), "asked the lead");
    let s = serve_with(Options {
        llm: Some(llm),
        ..Options::default()
    })
    .await;
    let (status, body) = s
        .post(
            "/api/agents/chief/messages",
            json!({"content": "ask the lead", "chat_id": "conv"}),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let request = body["envelope_id"].as_str().unwrap().to_string();
    let path = format!("/api/requests/{request}/tree");
    let member_turn_under_conversation = |tree: &serde_json::Value| {
        let nodes = tree["nodes"].as_array().cloned().unwrap_or_default();
        let conversation = nodes.iter().find(|n| n["kind"] == "conversation");
        conversation.is_some_and(|c| {
            nodes
                .iter()
                .any(|n| n["kind"] == "turn" && n["agent"] == "lead" && n["parent"] == c["id"])
        })
    };
    let tree = s.get_until(&path, member_turn_under_conversation).await;
    let nodes = tree["nodes"].as_array().unwrap();
    let conversation = nodes.iter().find(|n| n["kind"] == "conversation").unwrap();
    assert_eq!(conversation["agent"], "chief", "{conversation}");
    assert!(
        conversation["label"].as_str().unwrap().contains("lead"),
        "{conversation}"
    );
    let parent = &nodes[conversation["parent"].as_u64().unwrap() as usize];
    assert_eq!(parent["kind"], "turn", "{parent}");
    assert_eq!(parent["agent"], "chief", "{parent}");
    let member_turn = nodes
        .iter()
        .find(|n| n["agent"] == "lead" && n["parent"] == conversation["id"])
        .unwrap();
    assert_eq!(
        member_turn["label"].as_str().unwrap().split(" · ").next(),
        Some("turn in the conversation")
    );
}
