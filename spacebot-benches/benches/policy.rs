//! Policy checks on the hot path: `check_start`, `check_delegate` and `org_chart` over a
//! 64-agent organization.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use spacebot::policy::{LinkGraph, check_delegate, check_start, org_chart};
use spacebot::{AgentId, AgentLink, LinkDirection, LinkRelationship, Timestamp};

const AGENTS: usize = 64;

/// A tree (each agent superior of two, one-way), plus a two-way peer ring.
fn org() -> (Vec<AgentId>, LinkGraph) {
    // Every `agent-{i}` is a valid id, so all AGENTS are kept.
    let ids: Vec<AgentId> = (0..AGENTS)
        .filter_map(|i| AgentId::parse(format!("agent-{i}")).ok())
        .collect();
    assert_eq!(ids.len(), AGENTS);
    let mut links = Vec::new();
    for i in 1..AGENTS {
        links.push(AgentLink::new(
            ids[(i - 1) / 2].clone(),
            ids[i].clone(),
            LinkDirection::OneWay,
            LinkRelationship::Superior,
            Timestamp(0),
        ));
    }
    for i in 0..AGENTS {
        let j = (i + 7) % AGENTS;
        links.push(AgentLink::new(
            ids[i].clone(),
            ids[j].clone(),
            LinkDirection::TwoWay,
            LinkRelationship::Peer,
            Timestamp(0),
        ));
    }
    let graph = LinkGraph::new(ids.clone(), links);
    (ids, graph)
}

fn bench(c: &mut Criterion) {
    let (ids, graph) = org();
    let pairs: Vec<(usize, usize)> = (0..AGENTS)
        .flat_map(|a| {
            [
                (a, (2 * a + 1) % AGENTS),
                (a, (a + 7) % AGENTS),
                (a, (a + 3) % AGENTS),
            ]
        })
        .collect();
    c.bench_function("check_start (allowed and denied mix)", |b| {
        let mut i = 0;
        b.iter(|| {
            let (x, y) = pairs[i % pairs.len()];
            i += 1;
            black_box(check_start(&graph, &ids[x], &ids[y]).is_ok())
        })
    });
    c.bench_function("check_start (allowed)", |b| {
        b.iter(|| black_box(check_start(&graph, &ids[0], &ids[1]).is_ok()))
    });
    let chain = [ids[0].clone(), ids[1].clone()];
    c.bench_function("check_delegate (chain of 2)", |b| {
        b.iter(|| black_box(check_delegate(&graph, &ids[3], &ids[7], &chain, 4).is_ok()))
    });
    c.bench_function("org_chart", |b| {
        b.iter(|| black_box(org_chart(&graph, &ids[5])))
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
