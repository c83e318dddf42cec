//! The newest records of the channels a database's turns read lately, for
//! [`ChannelStore::history_texts`](spacebot_core::ChannelStore::history_texts): a turn reads its
//! channel's newest page ([`PAGE`] records) at every start, and a long channel's page is the same
//! 64 rows decoded again each time, less the few appended since. With the page kept, a read asks
//! the database only for the rows after the newest it holds (an index seek, usually one to three
//! rows).
//!
//! Why that is exact: an agent's channel records are only ever appended (no statement updates or
//! deletes one), their sequence numbers increase strictly per agent, and one writer numbers and
//! commits them in order. So a snapshot that shows a record numbered `n` shows every committed
//! record of the agent numbered below `n`, and the rows of a channel after the newest one kept
//! are exactly what was appended since. Only rows read from a snapshot (committed) are kept.
//!
//! Bounded: at most [`MAX_CHANNELS`] channels and [`MAX_BYTES`] of text; past either, the least
//! recently read half goes (a page bigger than a quarter of the bytes is not kept at all).

use std::collections::{HashMap, VecDeque};

use spacebot_core::channel::HistoryText;

/// The records kept per channel: a turn's page (`spacebot_core::context::HISTORY_PAGE`).
pub(crate) const PAGE: usize = 64;
/// The most channels kept.
const MAX_CHANNELS: usize = 1024;
/// The most text kept (authors and contents), in bytes.
const MAX_BYTES: usize = 16 << 20;

/// One channel's newest records, oldest first: the newest `min(PAGE, all)` of the channel as of
/// the newest snapshot read.
#[derive(Debug, Default)]
struct Page {
    texts: VecDeque<HistoryText>,
    /// The newest sequence number read (0: the channel had no record).
    newest: u64,
    bytes: usize,
    /// When it was last read (the cache's clock, [`HistoryCache::tick`]).
    used: u64,
}

fn size(text: &HistoryText) -> usize {
    text.author.as_str().len() + text.content.as_str().len()
}

/// The cache of a database (see the module's documentation).
#[derive(Debug, Default)]
pub(crate) struct HistoryCache {
    /// By the agent's key in the database, then by channel.
    agents: HashMap<String, HashMap<String, Page>>,
    channels: usize,
    bytes: usize,
    /// Counts reads: what a page's `used` is measured in.
    tick: u64,
}

impl HistoryCache {
    /// The newest sequence number kept of `key`'s `channel`, if the channel is kept (a read of
    /// it: it is then the most recently read).
    pub(crate) fn newest(&mut self, key: &str, channel: &str) -> Option<u64> {
        self.tick += 1;
        let page = self.agents.get_mut(key)?.get_mut(channel)?;
        page.used = self.tick;
        Some(page.newest)
    }

    /// Keeps `page`, the newest `min(PAGE, all)` records of the channel read from one snapshot
    /// (oldest first), unless what is kept is as new already.
    pub(crate) fn fill(&mut self, key: &str, channel: &str, page: &[HistoryText]) {
        let newest = page.last().map_or(0, |t| t.seq);
        if self
            .agents
            .get(key)
            .and_then(|c| c.get(channel))
            .is_some_and(|kept| kept.newest >= newest)
        {
            return;
        }
        let bytes: usize = page.iter().map(size).sum();
        if bytes > MAX_BYTES / 4 {
            self.forget(key, channel);
            return;
        }
        self.forget(key, channel);
        self.make_room(bytes);
        let start = page.len().saturating_sub(PAGE);
        self.channels += 1;
        self.bytes += bytes;
        self.tick += 1;
        self.agents.entry(key.to_owned()).or_default().insert(
            channel.to_owned(),
            Page {
                texts: page[start..].iter().cloned().collect(),
                newest,
                bytes,
                used: self.tick,
            },
        );
    }

    /// Adds `newer`, the channel's records after number `after` read from one snapshot (oldest
    /// first, fewer than [`PAGE`] + 1), to what is kept, and answers the newest `limit` records
    /// kept; `None` when the channel is not kept any more (forgotten meanwhile: read the page).
    pub(crate) fn extend(
        &mut self,
        key: &str,
        channel: &str,
        after: u64,
        newer: Vec<HistoryText>,
        limit: usize,
    ) -> Option<Vec<HistoryText>> {
        let page = self.agents.get_mut(key)?.get_mut(channel)?;
        if page.newest < after {
            // Forgotten and filled again meanwhile from an older snapshot: the rows between the
            // two are in neither.
            return None;
        }
        // Another read may have kept rows past `after` meanwhile: only the ones past it are new.
        let mut added = 0usize;
        for text in newer {
            if text.seq > page.newest {
                page.newest = text.seq;
                added += size(&text);
                page.bytes += size(&text);
                page.texts.push_back(text);
            }
        }
        let mut removed = 0usize;
        while page.texts.len() > PAGE {
            if let Some(old) = page.texts.pop_front() {
                removed += size(&old);
                page.bytes -= size(&old);
            }
        }
        let answer = page
            .texts
            .iter()
            .skip(page.texts.len().saturating_sub(limit))
            .cloned()
            .collect();
        let too_big = page.bytes > MAX_BYTES / 4;
        self.bytes = self.bytes + added - removed;
        if too_big {
            self.forget(key, channel);
        } else if self.bytes > MAX_BYTES {
            self.make_room(0);
        }
        Some(answer)
    }

    fn forget(&mut self, key: &str, channel: &str) {
        if let Some(page) = self.agents.get_mut(key).and_then(|c| c.remove(channel)) {
            self.channels -= 1;
            self.bytes -= page.bytes;
        }
    }

    /// If keeping one more page of `bytes` would pass a bound, forgets the least recently read
    /// pages until half of each bound is left (at once, so that a cache read round a larger set
    /// of channels does not sort its pages at every read).
    fn make_room(&mut self, bytes: usize) {
        if self.channels < MAX_CHANNELS && self.bytes + bytes <= MAX_BYTES {
            return;
        }
        let mut pages: Vec<(u64, String, String)> = self
            .agents
            .iter()
            .flat_map(|(key, channels)| {
                channels
                    .iter()
                    .map(move |(channel, page)| (page.used, key.clone(), channel.clone()))
            })
            .collect();
        pages.sort_unstable_by_key(|(used, ..)| *used);
        for (_, key, channel) in pages {
            if self.channels <= MAX_CHANNELS / 2 && self.bytes + bytes <= MAX_BYTES / 2 {
                break;
            }
            self.forget(&key, &channel);
        }
    }

    #[cfg(test)]
    fn clear(&mut self) {
        self.agents.clear();
        self.channels = 0;
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use spacebot_core::RecordKind;

    fn text(seq: u64, content: &str) -> HistoryText {
        HistoryText {
            seq,
            kind: RecordKind::User,
            author: "u".into(),
            content: content.into(),
        }
    }

    fn seqs(texts: &[HistoryText]) -> Vec<u64> {
        texts.iter().map(|t| t.seq).collect()
    }

    #[test]
    fn a_kept_page_grows_by_the_newer_rows_and_keeps_its_newest_page() {
        let mut cache = HistoryCache::default();
        let page: Vec<_> = (1..=3).map(|s| text(s, "x")).collect();
        cache.fill("a", "c", &page);
        assert_eq!(cache.newest("a", "c"), Some(3));
        let newer: Vec<_> = (4..=70).map(|s| text(s, "x")).collect();
        let answer = cache.extend("a", "c", 3, newer, 2).unwrap();
        assert_eq!(seqs(&answer), vec![69, 70]);
        let all = cache.extend("a", "c", 70, Vec::new(), PAGE).unwrap();
        assert_eq!(seqs(&all), (7..=70).collect::<Vec<_>>());
        assert_eq!(cache.bytes, PAGE * 2);
    }

    #[test]
    fn rows_another_read_kept_already_are_not_kept_twice() {
        let mut cache = HistoryCache::default();
        cache.fill("a", "c", &[text(1, "x")]);
        cache.extend("a", "c", 1, vec![text(2, "x"), text(3, "x")], PAGE);
        // A read that began before the one above answers rows 2 and 3 again, and row 4.
        let answer = cache
            .extend(
                "a",
                "c",
                1,
                vec![text(2, "x"), text(3, "x"), text(4, "x")],
                PAGE,
            )
            .unwrap();
        assert_eq!(seqs(&answer), vec![1, 2, 3, 4]);
        // An older page does not replace a newer one.
        cache.fill("a", "c", &[text(1, "x")]);
        assert_eq!(cache.newest("a", "c"), Some(4));
        // Forgotten, then filled from a snapshot older than a read's: that read's rows would
        // leave a gap, and are not added.
        cache.clear();
        cache.fill("a", "c", &[text(1, "x")]);
        assert!(
            cache
                .extend("a", "c", 4, vec![text(5, "x")], PAGE)
                .is_none()
        );
        assert_eq!(cache.newest("a", "c"), Some(1));
    }

    #[test]
    fn past_its_bounds_the_least_recently_read_half_goes() {
        let mut cache = HistoryCache::default();
        for i in 0..MAX_CHANNELS {
            cache.fill("a", &format!("c{i}"), &[text(1, "x")]);
        }
        assert_eq!(cache.channels, MAX_CHANNELS);
        // Read lately: kept.
        assert_eq!(cache.newest("a", "c0"), Some(1));
        cache.fill("b", "one more", &[text(1, "x")]);
        assert_eq!(cache.channels, MAX_CHANNELS / 2 + 1);
        assert_eq!(cache.bytes, (MAX_CHANNELS / 2 + 1) * 2);
        assert_eq!(cache.newest("a", "c0"), Some(1));
        assert_eq!(cache.newest("a", "c1"), None);
        assert_eq!(cache.newest("a", &format!("c{}", MAX_CHANNELS / 2)), None);
        assert_eq!(
            cache.newest("a", &format!("c{}", MAX_CHANNELS / 2 + 1)),
            Some(1)
        );
        assert_eq!(cache.newest("b", "one more"), Some(1));
        // A page too big to keep is not kept.
        cache.clear();
        cache.fill("a", "one more", &[text(1, "x")]);
        let big = "x".repeat(MAX_BYTES / 4 + 1);
        cache.fill("a", "big", &[text(1, &big)]);
        assert_eq!(cache.newest("a", "big"), None);
        assert_eq!(cache.bytes, 2);
        // A kept page that grows too big is forgotten.
        assert!(
            cache
                .extend("a", "one more", 1, vec![text(2, &big)], 1)
                .is_some()
        );
        assert_eq!(cache.newest("a", "one more"), None);
        assert_eq!((cache.channels, cache.bytes), (0, 0));
        // Pages that pass the bytes bound together make room by the least recently read.
        let quarter = "x".repeat(MAX_BYTES / 4 - 1);
        for i in 0..4 {
            cache.fill("a", &format!("q{i}"), &[text(1, &quarter)]);
        }
        assert_eq!(cache.channels, 4);
        assert_eq!(cache.newest("a", "q0"), Some(1));
        cache.fill("a", "q4", &[text(1, &quarter)]);
        assert!(cache.bytes <= MAX_BYTES, "{}", cache.bytes);
        assert_eq!(cache.newest("a", "q0"), Some(1));
        assert_eq!(cache.newest("a", "q1"), None);
        assert_eq!(cache.newest("a", "q4"), Some(1));
    }
}
