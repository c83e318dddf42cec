//! Spend and limits: a request's spend, an operator raising its limits and resuming it, the
//! spend of agents and of the organization over their periods.

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use serde::{Deserialize, Serialize};
use spacebot_core::EnvelopeId;
use spacebot_core::limits::{LedgerEntry, Limits, Money, Period, Scope, Spend};
use utoipa::ToSchema;

use crate::error::{ApiError, ErrorBody};
use crate::extract::ApiJson;
use crate::extract::ApiPath as Path;
use crate::views::Accepted;

use super::{ApiResult, St, known_agent};

/// Limits on a measure each; absent is no limit.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LimitsBody {
    /// Prompt (input) tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_tokens: Option<u64>,
    /// Completion (output) tokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_tokens: Option<u64>,
    /// Tokens in all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub total_tokens: Option<u64>,
    /// Model calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_calls: Option<u64>,
    /// Tool calls.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<u64>,
    /// Milliseconds from the request's first turn.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wall_time_ms: Option<u64>,
    /// Cost, in units of the price table's currency.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cost: Option<f64>,
}

impl LimitsBody {
    /// The core limits; a bad cost is a 400 naming `field`.
    pub(crate) fn to_limits(&self, field: &str) -> ApiResult<Limits> {
        let cost = match self.cost {
            None => None,
            Some(units) => Some(Money::from_units(units).ok_or_else(|| {
                ApiError::invalid(field, format!("cost {units} is not an amount of 0 or more"))
            })?),
        };
        Ok(Limits {
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            total_tokens: self.total_tokens,
            model_calls: self.model_calls,
            tool_calls: self.tool_calls,
            wall_time_ms: self.wall_time_ms,
            cost,
        })
    }
}

impl From<Limits> for LimitsBody {
    fn from(l: Limits) -> Self {
        Self {
            input_tokens: l.input_tokens,
            output_tokens: l.output_tokens,
            total_tokens: l.total_tokens,
            model_calls: l.model_calls,
            tool_calls: l.tool_calls,
            wall_time_ms: l.wall_time_ms,
            cost: l.cost.map(Money::units),
        }
    }
}

/// What was spent.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct SpendView {
    /// Prompt (input) tokens.
    pub input_tokens: u64,
    /// Completion (output) tokens.
    pub output_tokens: u64,
    /// Tokens in all.
    pub total_tokens: u64,
    /// Model calls.
    pub model_calls: u64,
    /// Tool calls.
    pub tool_calls: u64,
    /// Cost, in units of the price table's currency (0 without a price table).
    pub cost: f64,
}

impl From<Spend> for SpendView {
    fn from(s: Spend) -> Self {
        Self {
            input_tokens: s.input_tokens,
            output_tokens: s.output_tokens,
            total_tokens: s.total_tokens,
            model_calls: s.model_calls,
            tool_calls: s.tool_calls,
            cost: s.cost.units(),
        }
    }
}

/// The limit a request reached.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ReachedView {
    /// The measure (`total_tokens`, `model_calls`, `cost`, ...).
    pub limit: String,
    /// Its limit.
    pub max: u64,
    /// What the refused call would have reached.
    pub value: u64,
    /// The reason as the user was told it.
    pub message: String,
}

/// A request's spend and limits.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RequestSpendView {
    /// The request (the id of the message that started it).
    pub request: String,
    /// Its own limits (they bind with the organization's `[settings.limits]`).
    pub limits: LimitsBody,
    /// What its settled calls spent.
    pub spent: SpendView,
    /// What its open reservations hold.
    pub reserved: SpendView,
    /// The limit it reached, if it did (it stays stopped until its limits change).
    pub reached: Option<ReachedView>,
}

impl RequestSpendView {
    pub(crate) fn new(request: &EnvelopeId, e: &LedgerEntry) -> Self {
        let reserved = e
            .reserved
            .values()
            .fold(Spend::default(), |sum, r| sum.plus(r));
        Self {
            request: request.to_string(),
            limits: e.limits.into(),
            spent: e.settled.into(),
            reserved: reserved.into(),
            reached: e.reached.as_ref().map(|r| ReachedView {
                limit: serde_json::to_value(r.over.limit)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_owned))
                    .unwrap_or_default(),
                max: r.over.max,
                value: r.over.value,
                message: r.to_string(),
            }),
        }
    }
}

/// An operator's message resuming a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResumeBody {
    /// The agent to resume it on (usually the one the request was sent to).
    pub agent: String,
    /// What to tell it (not empty).
    pub content: String,
    /// The web chat the reply goes to (default `dashboard`).
    #[serde(default)]
    pub chat_id: Option<String>,
}

/// The spend of one period scope.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PeriodSpendView {
    /// `hour` or `day`.
    pub period: String,
    /// What was spent (reservations included) in the last hour or day.
    pub spent: SpendView,
    /// The limits binding it.
    pub limits: LimitsBody,
}

fn request_id(request: &str) -> ApiResult<EnvelopeId> {
    if request.is_empty() || request.len() > 200 || request.chars().any(char::is_control) {
        return Err(ApiError::invalid("request", "not a request id"));
    }
    Ok(EnvelopeId::new(request))
}

async fn spend_view(st: &super::AppState, id: &EnvelopeId) -> ApiResult<RequestSpendView> {
    let entry = st.org.request_spend(id).await?.ok_or_else(|| {
        ApiError::not_found(format!("no spend on record for request {id}")).with_field("request")
    })?;
    Ok(RequestSpendView::new(id, &entry))
}

/// A request's spend, reservations and limits (kept while some limit is in use).
#[utoipa::path(get, path = "/api/requests/{request}/spend", tag = "limits",
    params(("request" = String, Path, description = "The request: the envelope id a message was accepted as")),
    responses((status = 200, body = RequestSpendView), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn request_spend(
    State(st): St,
    Path(request): Path<String>,
) -> ApiResult<Json<RequestSpendView>> {
    let id = request_id(&request)?;
    Ok(Json(spend_view(&st, &id).await?))
}

/// Replaces a request's own limits (an operator raising or lowering them); a request stopped at a
/// limit may spend again. Resume it with `POST /api/requests/{request}/resume`.
#[utoipa::path(put, path = "/api/requests/{request}/limits", tag = "limits",
    params(("request" = String, Path, description = "The request")),
    request_body = LimitsBody,
    responses((status = 200, body = RequestSpendView), (status = 400, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn set_request_limits(
    State(st): St,
    Path(request): Path<String>,
    ApiJson(body): ApiJson<LimitsBody>,
) -> ApiResult<Json<RequestSpendView>> {
    let id = request_id(&request)?;
    let limits = body.to_limits("cost")?;
    st.org.set_request_limits(&id, limits).await?;
    Ok(Json(spend_view(&st, &id).await?))
}

/// Resumes a request (after its limits were raised): delivers the operator's message to an agent
/// as part of the request.
#[utoipa::path(post, path = "/api/requests/{request}/resume", tag = "limits",
    params(("request" = String, Path, description = "The request")),
    request_body = ResumeBody,
    responses((status = 202, body = Accepted), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn resume_request(
    State(st): St,
    Path(request): Path<String>,
    ApiJson(body): ApiJson<ResumeBody>,
) -> ApiResult<(StatusCode, Json<Accepted>)> {
    let id = request_id(&request)?;
    let agent = st.org.resolve(&body.agent)?;
    if body.content.trim().is_empty() {
        return Err(ApiError::invalid("content", "the message is empty"));
    }
    let chat = body.chat_id.unwrap_or_else(|| "dashboard".to_string());
    if chat.is_empty() || chat.len() > 128 || chat.chars().any(char::is_control) {
        return Err(ApiError::invalid(
            "chat_id",
            "a chat id is 1 to 128 characters without control characters",
        ));
    }
    let platform = crate::WebChat::PLATFORM;
    let message = spacebot_core::InboundMessage::new(platform, chat.clone(), body.content);
    let envelope = st.org.resume_request(agent.as_str(), &id, message).await?;
    Ok((
        StatusCode::ACCEPTED,
        Json(Accepted {
            envelope_id: envelope.to_string(),
            agent: agent.to_string(),
            channel: format!("{platform}:{chat}"),
        }),
    ))
}

fn period_name(p: Period) -> &'static str {
    match p {
        Period::Hour => "hour",
        Period::Day => "day",
    }
}

/// The spend of a period scope and the limits binding it: an operator's (set at run time) when
/// there are any, else the configured ones; `None` when neither limits it.
async fn period_view(
    st: &super::AppState,
    scope: &Scope,
    period: Period,
    configured: Option<Limits>,
) -> ApiResult<Option<PeriodSpendView>> {
    let Some(limits) = st.org.period_limits(scope).await?.or(configured) else {
        return Ok(None);
    };
    let spent = st.org.period_spend(scope).await?;
    Ok(Some(PeriodSpendView {
        period: period_name(period).to_owned(),
        spent: spent.into(),
        limits: limits.into(),
    }))
}

/// The period of a path (`hour` or `day`).
fn period_of(raw: &str) -> ApiResult<Period> {
    match raw {
        "hour" => Ok(Period::Hour),
        "day" => Ok(Period::Day),
        _ => Err(ApiError::invalid(
            "period",
            format!("unknown period {raw:?}: expected \"hour\" or \"day\""),
        )),
    }
}

/// What an agent spent over each of its limited periods (`[settings.agent_limits]`, its own
/// `limits`, an operator's set at run time); empty when none is set.
#[utoipa::path(get, path = "/api/agents/{agent}/spend", tag = "limits",
    params(("agent" = String, Path, description = "Agent id")),
    responses((status = 200, body = [PeriodSpendView]), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn agent_spend(
    State(st): St,
    Path(agent): Path<String>,
) -> ApiResult<Json<Vec<PeriodSpendView>>> {
    let id = known_agent(&st.org, &agent)?;
    let config = st.org.config();
    let own = config
        .agents
        .iter()
        .find(|a| a.id == id)
        .and_then(|a| a.limits);
    let mut out: Vec<PeriodSpendView> = Vec::new();
    for period in [Period::Hour, Period::Day] {
        let configured = [config.settings.agent_limits, own]
            .into_iter()
            .flatten()
            .filter(|p| p.period == period)
            .map(|p| p.limits)
            .reduce(|a, b| a.tighter(&b));
        let scope = Scope::Agent {
            agent: id.clone(),
            period,
        };
        if let Some(view) = period_view(&st, &scope, period, configured).await? {
            out.push(view);
        }
    }
    Ok(Json(out))
}

/// What the organization spent over its limited periods (`[settings.org_limits]`, an
/// operator's set at run time); empty when none is set.
#[utoipa::path(get, path = "/api/spend", tag = "limits",
    responses((status = 200, body = [PeriodSpendView])),
    security(("bearer" = [])))]
pub(crate) async fn org_spend(State(st): St) -> ApiResult<Json<Vec<PeriodSpendView>>> {
    let config = st.org.config();
    let mut out = Vec::new();
    for period in [Period::Hour, Period::Day] {
        let configured = config
            .settings
            .org_limits
            .filter(|p| p.period == period)
            .map(|p| p.limits);
        if let Some(view) =
            period_view(&st, &Scope::Organization { period }, period, configured).await?
        {
            out.push(view);
        }
    }
    Ok(Json(out))
}

/// Sets an operator's limits for an agent's hour or day, replacing the configured ones from its
/// next call on; stored (kept across restarts).
#[utoipa::path(put, path = "/api/agents/{agent}/limits/{period}", tag = "limits",
    params(("agent" = String, Path, description = "Agent id"),
        ("period" = String, Path, description = "`hour` or `day`")),
    request_body = LimitsBody,
    responses((status = 200, body = [PeriodSpendView]), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn set_agent_limits(
    State(st): St,
    Path((agent, period)): Path<(String, String)>,
    ApiJson(body): ApiJson<LimitsBody>,
) -> ApiResult<Json<Vec<PeriodSpendView>>> {
    let id = known_agent(&st.org, &agent)?;
    let period = period_of(&period)?;
    let limits = body.to_limits("cost")?;
    let scope = Scope::Agent { agent: id, period };
    st.org.set_period_limits(&scope, Some(limits)).await?;
    agent_spend(State(st), Path(agent)).await
}

/// Clears an operator's limits for an agent's hour or day: the configured ones apply again.
#[utoipa::path(delete, path = "/api/agents/{agent}/limits/{period}", tag = "limits",
    params(("agent" = String, Path, description = "Agent id"),
        ("period" = String, Path, description = "`hour` or `day`")),
    responses((status = 200, body = [PeriodSpendView]), (status = 400, body = ErrorBody),
        (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn clear_agent_limits(
    State(st): St,
    Path((agent, period)): Path<(String, String)>,
) -> ApiResult<Json<Vec<PeriodSpendView>>> {
    let id = known_agent(&st.org, &agent)?;
    let period = period_of(&period)?;
    let scope = Scope::Agent { agent: id, period };
    st.org.set_period_limits(&scope, None).await?;
    agent_spend(State(st), Path(agent)).await
}

/// Sets an operator's limits for the organization's hour or day, replacing the configured ones
/// from the next call on; stored (kept across restarts).
#[utoipa::path(put, path = "/api/limits/{period}", tag = "limits",
    params(("period" = String, Path, description = "`hour` or `day`")),
    request_body = LimitsBody,
    responses((status = 200, body = [PeriodSpendView]), (status = 400, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn set_org_limits(
    State(st): St,
    Path(period): Path<String>,
    ApiJson(body): ApiJson<LimitsBody>,
) -> ApiResult<Json<Vec<PeriodSpendView>>> {
    let period = period_of(&period)?;
    let limits = body.to_limits("cost")?;
    st.org
        .set_period_limits(&Scope::Organization { period }, Some(limits))
        .await?;
    org_spend(State(st)).await
}

/// Clears an operator's limits for the organization's hour or day.
#[utoipa::path(delete, path = "/api/limits/{period}", tag = "limits",
    params(("period" = String, Path, description = "`hour` or `day`")),
    responses((status = 200, body = [PeriodSpendView]), (status = 400, body = ErrorBody)),
    security(("bearer" = [])))]
pub(crate) async fn clear_org_limits(
    State(st): St,
    Path(period): Path<String>,
) -> ApiResult<Json<Vec<PeriodSpendView>>> {
    let period = period_of(&period)?;
    st.org
        .set_period_limits(&Scope::Organization { period }, None)
        .await?;
    org_spend(State(st)).await
}
