//! The schedule of a replay: which trace requests, at which simulated arrival times.

use std::time::Duration;

use kvroute_common::trace::TraceRequest;

use super::sessions::SessionKeys;

/// A trace, cut and time-scaled: request `i` arrives `arrivals[i]` (simulated) after the first.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub requests: Vec<TraceRequest>,
    pub arrivals: Vec<Duration>,
    /// The factor applied to the trace's timestamps.
    pub time_scale: f64,
    /// The requests' sessions, when the trace names any.
    pub sessions: Option<SessionKeys>,
}

impl Plan {
    /// The first `limit` requests (0 = all), arrivals relative to the first scaled by
    /// `time_scale`, or by the factor that makes the last arrive `target_duration` after the
    /// first (a trace whose requests all arrive together keeps its arrivals at zero).
    pub fn new(
        mut requests: Vec<TraceRequest>,
        limit: usize,
        time_scale: f64,
        target_duration: Option<Duration>,
    ) -> Self {
        if limit > 0 {
            requests.truncate(limit);
        }
        let first = requests.first().map_or(0, |r| r.timestamp);
        let span_ms = requests
            .iter()
            .map(|r| r.timestamp.saturating_sub(first))
            .max()
            .unwrap_or(0);
        let time_scale = match target_duration {
            Some(d) if span_ms > 0 => d.as_secs_f64() * 1e3 / span_ms as f64,
            _ => time_scale,
        };
        let arrivals = requests
            .iter()
            .map(|r| {
                Duration::from_secs_f64(r.timestamp.saturating_sub(first) as f64 * time_scale / 1e3)
            })
            .collect();
        Self {
            sessions: SessionKeys::of(&requests),
            requests,
            arrivals,
            time_scale,
        }
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(timestamp: u64) -> TraceRequest {
        TraceRequest {
            timestamp,
            input_length: 10,
            output_length: 1,
            hash_ids: vec![0],
            ..TraceRequest::default()
        }
    }

    #[test]
    fn cuts_and_scales() {
        let trace = vec![at(1000), at(1500), at(3000), at(9000)];
        let p = Plan::new(trace.clone(), 3, 0.5, None);
        assert_eq!(p.len(), 3);
        assert_eq!(
            p.arrivals,
            vec![
                Duration::ZERO,
                Duration::from_millis(250),
                Duration::from_secs(1)
            ]
        );
        let p = Plan::new(trace.clone(), 0, 1.0, Some(Duration::from_secs(16)));
        assert_eq!(p.len(), 4);
        assert_eq!(p.time_scale, 2.0);
        assert_eq!(p.arrivals[3], Duration::from_secs(16));
        let together = Plan::new(vec![at(5), at(5)], 0, 1.0, Some(Duration::from_secs(3)));
        assert_eq!(together.arrivals, vec![Duration::ZERO; 2]);
    }
}
