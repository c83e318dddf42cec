//! What telemetry costs a turn (deliver, the model answers at once, the reply is out; in-memory
//! stores, one core):
//!
//! - `otel/turn/no_subscriber`: no `tracing` subscriber. Run it in a build without the `otel`
//!   feature and in one with it: the spans are compiled in either way (they are `tracing` spans of
//!   the core), the feature adds only the exporter.
//! - `otel/turn/exported` (feature `otel`): every span exported over OTLP/HTTP by the batch
//!   exporter to a local endpoint that accepts everything.
//!
//! ```text
//! cargo bench -p spacebot-benches --bench telemetry
//! cargo bench -p spacebot-benches --bench telemetry --features otel
//! ```
//!
//! With `SPACEBOT_BENCH_TURNS=N` set, the binary runs N turns with no subscriber and exits instead
//! (no criterion): run it under `perf stat -e instructions:u` with N and 2N turns, and the
//! difference divided by N is the instructions one turn costs, free of the timing noise of a shared
//! machine (docs/observability.md).

#![allow(clippy::expect_used, clippy::unwrap_used)] // A benchmark set-up that fails should stop the run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group};
use futures::StreamExt;
use spacebot::config::OrgConfig;
use spacebot::{InboundMessage, Organization, Replies, Stores};
use spacebot_benches::Stub;

const CONFIG: &str = r#"
[[agents]]
id = "a"
name = "Alpha"

[[agents]]
id = "b"
name = "Beta"

[[links]]
from = "a"
to = "b"
relationship = "superior"
"#;

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

async fn organization() -> (Organization, Replies) {
    let org = Organization::builder(OrgConfig::from_toml_str(CONFIG).unwrap())
        .stores(Stores::memory())
        .llm(Arc::new(Stub))
        .build()
        .await
        .expect("organization");
    org.start_all().await.expect("start");
    let replies = org.take_replies().expect("replies");
    (org, replies)
}

fn bench_turns(c: &mut Criterion, name: &str) {
    let mut group = c.benchmark_group("otel/turn");
    group
        .sample_size(30)
        .measurement_time(Duration::from_secs(5));
    group.throughput(Throughput::Elements(1));
    let rt = runtime();
    let (org, mut replies) = rt.block_on(organization());
    group.bench_function(name, |b| {
        b.iter_custom(|iters| {
            rt.block_on(async {
                let start = Instant::now();
                for _ in 0..iters {
                    org.deliver("a", InboundMessage::new("portal", "u", "hi"))
                        .await
                        .unwrap();
                    replies.next().await.unwrap();
                }
                start.elapsed()
            })
        })
    });
    group.finish();
    rt.block_on(org.shutdown()).unwrap();
}

fn no_subscriber(c: &mut Criterion) {
    bench_turns(c, "no_subscriber");
}

/// An HTTP endpoint on a thread of its own answering 200 to every request.
#[cfg(feature = "otel")]
fn sink() -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut buffer = vec![0u8; 1 << 16];
                let mut seen = Vec::new();
                loop {
                    let Ok(n) = stream.read(&mut buffer) else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    seen.extend_from_slice(&buffer[..n]);
                    // One request at a time: answer once its body is in.
                    let text = String::from_utf8_lossy(&seen).to_string();
                    let Some(head_end) = text.find("\r\n\r\n") else {
                        continue;
                    };
                    let length = text[..head_end]
                        .lines()
                        .find_map(|l| {
                            let (k, v) = l.split_once(':')?;
                            k.eq_ignore_ascii_case("content-length")
                                .then(|| v.trim().parse::<usize>().ok())?
                        })
                        .unwrap_or(0);
                    if seen.len() < head_end + 4 + length {
                        continue;
                    }
                    seen.drain(..head_end + 4 + length);
                    let _ = stream.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/x-protobuf\r\nContent-Length: 0\r\n\r\n",
                    );
                }
            });
        }
    });
    port
}

#[cfg(feature = "otel")]
fn exported(c: &mut Criterion) {
    let otel = spacebot::otel::builder()
        .endpoint(format!("http://127.0.0.1:{}", sink()))
        .init()
        .unwrap();
    bench_turns(c, "exported");
    otel.flush().unwrap();
}

#[cfg(not(feature = "otel"))]
fn exported(_c: &mut Criterion) {}

criterion_group!(benches, no_subscriber, exported);

/// Runs `turns` turns with no subscriber (see the module's documentation).
fn count_turns(turns: u64) {
    let rt = runtime();
    rt.block_on(async {
        let (org, mut replies) = organization().await;
        let start = Instant::now();
        for _ in 0..turns {
            org.deliver("a", InboundMessage::new("portal", "u", "hi"))
                .await
                .unwrap();
            replies.next().await.unwrap();
        }
        println!("{turns} turns in {:?}", start.elapsed());
        org.shutdown().await.unwrap();
    });
}

fn main() {
    if let Some(turns) = std::env::var("SPACEBOT_BENCH_TURNS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        count_turns(turns);
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
