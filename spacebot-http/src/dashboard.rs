//! The dashboard page and its assets, embedded in the binary.

use axum::Router;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;

const INDEX: &str = include_str!("../assets/index.html");
const APP_JS: &str = include_str!("../assets/app.js");
const APP_CSS: &str = include_str!("../assets/app.css");
const FAVICON: &str = include_str!("../assets/favicon.svg");
const CYTOSCAPE: &str = include_str!("../assets/vendor/cytoscape.min.js");
const CYTOSCAPE_LICENSE: &str = include_str!("../assets/vendor/cytoscape.LICENSE");

fn asset(content_type: &'static str, body: &'static str) -> impl IntoResponse + Clone {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
}

pub(crate) fn routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route(
            "/",
            get(|| async { asset("text/html; charset=utf-8", INDEX) }),
        )
        // The page names the icon; browsers that ask for /favicon.ico anyway get the same one.
        .route(
            "/favicon.svg",
            get(|| async { asset("image/svg+xml", FAVICON) }),
        )
        .route(
            "/favicon.ico",
            get(|| async { asset("image/svg+xml", FAVICON) }),
        )
        .route(
            "/assets/app.js",
            get(|| async { asset("text/javascript; charset=utf-8", APP_JS) }),
        )
        .route(
            "/assets/app.css",
            get(|| async { asset("text/css; charset=utf-8", APP_CSS) }),
        )
        .route(
            "/assets/vendor/cytoscape.min.js",
            get(|| async { asset("text/javascript; charset=utf-8", CYTOSCAPE) }),
        )
        .route(
            "/assets/vendor/cytoscape.LICENSE",
            get(|| async { asset("text/plain; charset=utf-8", CYTOSCAPE_LICENSE) }),
        )
}
