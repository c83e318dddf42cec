//! OpenTelemetry export (feature `otel`): the runtime's spans (see [`spacebot_core::telemetry`])
//! and metrics, sent over OTLP/HTTP (protobuf) to the collector the standard `OTEL_*` environment
//! variables name.
//!
//! ```no_run
//! # fn main() -> Result<(), spacebot::otel::OtelError> {
//! // OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318 OTEL_SERVICE_NAME=support-desk
//! let otel = spacebot::otel::init()?; // a global subscriber exporting spacebot's spans
//! // ... build and run the organization ...
//! drop(otel); // flushes what is left
//! # Ok(())
//! # }
//! ```
//!
//! An application with a subscriber of its own adds [`Otel::layer`] to it instead of calling
//! [`init`]. See `docs/observability.md` for what each span means and what is never recorded.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use opentelemetry::metrics::{Counter, Gauge, Histogram, Meter, MeterProvider as _};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry::{Array, KeyValue, StringValue, Value};
use opentelemetry_otlp::{MetricExporter, Protocol, SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use spacebot_core::telemetry::{self, ModelCall, TraceHook};
use spacebot_core::{AgentId, EventKind, Organization};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Why telemetry could not start or flush.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OtelError {
    /// An OTLP exporter could not be built (a bad endpoint, header or timeout setting).
    #[error("the OTLP exporter could not be built: {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    /// A global `tracing` subscriber is set already: add [`Otel::layer`] to it instead.
    #[error("a global tracing subscriber is set already: {0}")]
    Subscriber(String),
    /// Flushing or shutting down the exporters failed.
    #[error("telemetry could not be flushed: {0}")]
    Flush(String),
}

/// Telemetry settings: the `OTEL_*` environment variables, and what the code overrides.
#[derive(Debug, Clone, Default)]
pub struct OtelBuilder {
    endpoint: Option<String>,
    capture_content: Option<bool>,
    metric_interval: Option<Duration>,
}

/// Settings read from the `OTEL_*` environment variables (see [`OtelBuilder`]).
pub fn builder() -> OtelBuilder {
    OtelBuilder::default()
}

/// Starts exporting from the `OTEL_*` environment variables and sets a global `tracing`
/// subscriber that exports spacebot's spans: [`builder`]`().init()`.
pub fn init() -> Result<Otel, OtelError> {
    builder().init()
}

fn env_flag(name: &str) -> Option<bool> {
    std::env::var(name)
        .ok()
        .map(|v| v.trim().eq_ignore_ascii_case("true"))
}

impl OtelBuilder {
    /// The collector's base URL (`http://host:4318`), instead of `OTEL_EXPORTER_OTLP_ENDPOINT`;
    /// traces go to `/v1/traces`, metrics to `/v1/metrics` under it.
    pub fn endpoint(mut self, base: impl Into<String>) -> Self {
        self.endpoint = Some(base.into());
        self
    }

    /// Whether prompt, answer and tool-argument text goes into spans. Off unless this or
    /// `OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true` turns it on.
    pub fn capture_content(mut self, on: bool) -> Self {
        self.capture_content = Some(on);
        self
    }

    /// How often metrics are exported, instead of `OTEL_METRIC_EXPORT_INTERVAL` (60 s).
    pub fn metric_interval(mut self, every: Duration) -> Self {
        self.metric_interval = Some(every);
        self
    }

    /// Builds the exporters and installs the runtime's trace hook; add [`Otel::layer`] to your
    /// subscriber. `OTEL_SDK_DISABLED=true` gives an [`Otel`] that exports nothing.
    pub fn build(self) -> Result<Otel, OtelError> {
        let disabled = env_flag("OTEL_SDK_DISABLED").unwrap_or(false);
        let resource = Resource::builder()
            .with_service_name(
                std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "spacebot".to_string()),
            )
            .build();
        let mut tracer_provider = SdkTracerProvider::builder().with_resource(resource.clone());
        let mut meter_provider = SdkMeterProvider::builder().with_resource(resource);
        if !disabled {
            let mut spans = SpanExporter::builder()
                .with_http()
                .with_protocol(Protocol::HttpBinary);
            let mut metrics = MetricExporter::builder()
                .with_http()
                .with_protocol(Protocol::HttpBinary);
            if let Some(base) = &self.endpoint {
                let base = base.trim_end_matches('/');
                spans = spans.with_endpoint(format!("{base}/v1/traces"));
                metrics = metrics.with_endpoint(format!("{base}/v1/metrics"));
            }
            tracer_provider = tracer_provider.with_batch_exporter(spans.build()?);
            let mut reader = opentelemetry_sdk::metrics::PeriodicReader::builder(metrics.build()?);
            if let Some(every) = self.metric_interval {
                reader = reader.with_interval(every);
            }
            meter_provider = meter_provider.with_reader(reader.build());
        }
        let tracer_provider = tracer_provider.build();
        let meter_provider = meter_provider.build();
        let capture = self
            .capture_content
            .or_else(|| env_flag("OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"))
            .unwrap_or(false);
        telemetry::set_capture_content(capture);
        let meter = meter_provider.meter("spacebot");
        // Installed once per process; a second `Otel` shares the first one's hook.
        let _ = telemetry::install(Box::new(Hook::new(&meter)));
        opentelemetry::global::set_meter_provider(meter_provider.clone());
        Ok(Otel {
            tracer_provider,
            meter_provider,
        })
    }

    /// [`build`](Self::build), then a global `tracing` subscriber exporting the spans of
    /// `spacebot` crates at `INFO` and above.
    pub fn init(self) -> Result<Otel, OtelError> {
        let otel = self.build()?;
        let filter = tracing_subscriber::filter::Targets::new()
            .with_target("spacebot", tracing::Level::INFO)
            .with_target("spacebot_core", tracing::Level::INFO);
        tracing_subscriber::registry()
            .with(tracing_subscriber::Layer::with_filter(otel.layer(), filter))
            .try_init()
            .map_err(|e| OtelError::Subscriber(e.to_string()))?;
        Ok(otel)
    }
}

/// Running telemetry: the exporters. Dropping it flushes and shuts them down (blocking while
/// the last batch is sent).
pub struct Otel {
    tracer_provider: SdkTracerProvider,
    meter_provider: SdkMeterProvider,
}

impl fmt::Debug for Otel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Otel").finish_non_exhaustive()
    }
}

impl Otel {
    /// The `tracing` layer turning spans into OpenTelemetry spans, for a subscriber of your own.
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S> + use<S>
    where
        S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    {
        tracing_opentelemetry::layer()
            .with_tracer(self.tracer_provider.tracer("spacebot"))
            .with_tracked_inactivity(false)
    }

    /// Sends every finished span and the current metrics now (blocking until the collector
    /// answered or the export timed out).
    pub fn flush(&self) -> Result<(), OtelError> {
        self.tracer_provider
            .force_flush()
            .map_err(|e| OtelError::Flush(e.to_string()))?;
        self.meter_provider
            .force_flush()
            .map_err(|e| OtelError::Flush(e.to_string()))
    }
}

impl Drop for Otel {
    fn drop(&mut self) {
        let _ = self.tracer_provider.shutdown();
        let _ = self.meter_provider.shutdown();
    }
}

/// The runtime's trace hook: W3C trace context in and out, string arrays, metrics.
struct Hook {
    propagator: TraceContextPropagator,
    tokens: Histogram<u64>,
    duration: Histogram<f64>,
    turn: Histogram<f64>,
}

impl fmt::Debug for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hook").finish_non_exhaustive()
    }
}

impl Hook {
    fn new(meter: &Meter) -> Self {
        Self {
            propagator: TraceContextPropagator::new(),
            tokens: meter
                .u64_histogram("gen_ai.client.token.usage")
                .with_unit("{token}")
                .with_description("Tokens used by model calls")
                .with_boundaries(vec![
                    1.0, 4.0, 16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0, 262144.0,
                    1048576.0,
                ])
                .build(),
            duration: meter
                .f64_histogram("gen_ai.client.operation.duration")
                .with_unit("s")
                .with_description("Duration of model calls")
                .build(),
            turn: meter
                .f64_histogram("spacebot.turn.duration")
                .with_unit("s")
                .with_description("Duration of agent turns")
                .build(),
        }
    }
}

impl TraceHook for Hook {
    fn context_of(&self, span: &Span) -> Option<String> {
        let cx = span.context();
        if !cx.span().span_context().is_valid() {
            return None;
        }
        let mut carrier = HashMap::new();
        self.propagator.inject_context(&cx, &mut carrier);
        let parent = carrier.remove("traceparent")?;
        Some(match carrier.remove("tracestate") {
            Some(state) if !state.is_empty() => format!("{parent}\n{state}"),
            _ => parent,
        })
    }

    fn continue_trace(&self, span: &Span, context: &str) {
        let mut carrier = HashMap::new();
        let mut lines = context.splitn(2, '\n');
        if let Some(parent) = lines.next() {
            carrier.insert("traceparent".to_string(), parent.to_string());
        }
        if let Some(state) = lines.next() {
            carrier.insert("tracestate".to_string(), state.to_string());
        }
        let cx = self.propagator.extract(&carrier);
        let remote = cx.span().span_context().clone();
        if !remote.is_valid() {
            return;
        }
        // The parent keeps the request one trace; the link says the span continues work stored
        // by a span that has (usually) ended, perhaps in another process.
        let _ = span.set_parent(cx);
        span.add_link_with_attributes(
            remote,
            vec![KeyValue::new("spacebot.link", "stored_context")],
        );
    }

    fn set_string_array(&self, span: &Span, key: &'static str, values: Vec<String>) {
        let values: Vec<StringValue> = values.into_iter().map(StringValue::from).collect();
        span.set_attribute(key, Value::Array(Array::String(values)));
    }

    fn model_call(&self, call: &ModelCall<'_>) {
        let mut attributes = vec![
            KeyValue::new("gen_ai.operation.name", "chat"),
            KeyValue::new("gen_ai.provider.name", call.provider.to_string()),
            KeyValue::new("gen_ai.request.model", call.model.to_string()),
        ];
        if let Some(error) = call.error {
            attributes.push(KeyValue::new("error.type", error));
        }
        self.duration
            .record(call.duration.as_secs_f64(), &attributes);
        if let Some(usage) = call.usage {
            for (kind, tokens) in [
                ("input", usage.prompt_tokens),
                ("output", usage.completion_tokens),
            ] {
                let mut with_type = attributes.clone();
                with_type.push(KeyValue::new("gen_ai.token.type", kind));
                self.tokens.record(u64::from(tokens), &with_type);
            }
        }
    }

    fn turn_ended(&self, agent: &AgentId, duration: Duration) {
        self.turn.record(
            duration.as_secs_f64(),
            &[KeyValue::new("gen_ai.agent.id", agent.to_string())],
        );
    }
}

/// Records the organization's metrics from its events until its event bus closes: tasks by
/// status (`spacebot.tasks`), retries (`spacebot.task.retries`), limit hits
/// (`spacebot.limit.hits`) and each agent's queue depth (`spacebot.queue.depth`). Spawn it
/// beside the organization.
pub async fn observe(org: Organization) {
    let meter = opentelemetry::global::meter("spacebot");
    let metrics = OrgMetrics::new(&meter);
    let mut events = org.subscribe();
    while let Ok(event) = events.recv().await {
        metrics.record(&org, &event);
    }
}

struct OrgMetrics {
    tasks: Counter<u64>,
    retries: Counter<u64>,
    limits: Counter<u64>,
    queue: Gauge<u64>,
}

impl OrgMetrics {
    fn new(meter: &Meter) -> Self {
        Self {
            tasks: meter
                .u64_counter("spacebot.tasks")
                .with_unit("{task}")
                .with_description("Task transitions, by the status reached")
                .build(),
            retries: meter
                .u64_counter("spacebot.task.retries")
                .with_unit("{attempt}")
                .with_description("Task attempts that failed and were requeued")
                .build(),
            limits: meter
                .u64_counter("spacebot.limit.hits")
                .with_unit("{refusal}")
                .with_description("Calls refused because a request reached a limit")
                .build(),
            queue: meter
                .u64_gauge("spacebot.queue.depth")
                .with_unit("{envelope}")
                .with_description("Envelopes waiting in an agent's queue")
                .build(),
        }
    }

    fn record(&self, org: &Organization, event: &spacebot_core::Event) {
        let agent = KeyValue::new("gen_ai.agent.id", event.agent.to_string());
        let status = match &event.kind {
            EventKind::TaskCreated { status, .. } => Some(status.as_str()),
            EventKind::TaskClaimed { .. } => Some("in_progress"),
            EventKind::TaskCompleted => Some("done"),
            EventKind::TaskFailed { .. } => Some("failed"),
            EventKind::TaskRequeued { .. } => {
                self.retries.add(1, std::slice::from_ref(&agent));
                Some("ready")
            }
            EventKind::TaskCancelled => Some("cancelled"),
            EventKind::LimitReached { over, .. } => {
                self.limits.add(
                    1,
                    &[
                        agent.clone(),
                        KeyValue::new("spacebot.limit", over.limit.to_string()),
                    ],
                );
                None
            }
            EventKind::RoundLimitReached { .. } => {
                self.limits.add(
                    1,
                    &[
                        agent.clone(),
                        KeyValue::new("spacebot.limit", "tool_rounds"),
                    ],
                );
                None
            }
            _ => None,
        };
        if let Some(status) = status {
            self.tasks.add(
                1,
                &[agent.clone(), KeyValue::new("spacebot.task.status", status)],
            );
        }
        if let Some(depth) = org.queue_len(&event.agent) {
            self.queue.record(depth as u64, &[agent]);
        }
    }
}
