//! The checked-in OpenAPI description is the one the code generates.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

#[test]
fn checked_in_openapi_matches_the_code() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.json");
    let generated = spacebot_http::openapi().to_pretty_json().unwrap() + "\n";
    if std::env::var_os("SPACEBOT_UPDATE_OPENAPI").is_some() {
        std::fs::write(path, &generated).unwrap();
    }
    let checked_in = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        checked_in == generated,
        "spacebot-http/openapi.json is out of date with the code. Regenerate it with\n\n    \
         SPACEBOT_UPDATE_OPENAPI=1 cargo test -p spacebot-http --test openapi\n\nand commit the result."
    );
    // Every path of the router is described.
    let doc: serde_json::Value = serde_json::from_str(&generated).unwrap();
    for path in [
        "/api/agents",
        "/api/links/{link}",
        "/api/events",
        "/api/topology",
        "/api/conversations/{conversation}/sever",
        "/api/agents/{agent}/tasks/{number}/approve",
        "/api/notes",
        "/api/notes/{name}",
        "/api/notes/{name}/history",
        "/api/notes/{name}/access/{agent}",
    ] {
        assert!(doc["paths"].get(path).is_some(), "{path} missing");
    }
    assert!(doc["components"]["securitySchemes"]["bearer"].is_object());
}
