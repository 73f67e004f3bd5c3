//! Rounds bounded in count and time, and what their durations sum up to.

use std::{
    future::Future,
    time::{Duration, Instant},
};

use serde_json::{json, Value};

use crate::progress;

/// How many rounds a case runs: at least `min` (even past `time`), at most `max`, and no
/// new one once `time` has passed.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Budget {
    pub(crate) min: u64,
    pub(crate) max: u64,
    pub(crate) time: Duration,
}

/// Runs `round` within `budget`, showing progress; each round returns the time it measured
/// (its own setup excluded).
pub(crate) async fn rounds<F, Fut>(budget: Budget, mut round: F) -> Result<Vec<Duration>, String>
where
    F: FnMut(u64) -> Fut,
    Fut: Future<Output = Result<Duration, String>>,
{
    let started = Instant::now();
    let mut samples = Vec::new();
    for i in 0..budget.max {
        if i >= budget.min && started.elapsed() >= budget.time {
            break;
        }
        samples.push(round(i).await?);
        if i == 0 {
            // The first round shows what a round costs: plan on it.
            let per_round = samples[0].max(Duration::from_micros(1));
            let fits = (budget.time.as_secs_f64() / per_round.as_secs_f64()) as u64;
            progress::replan(fits.clamp(budget.min, budget.max));
        }
        progress::tick(i + 1);
    }
    Ok(samples)
}

/// The distribution of a case's round times.
#[derive(Debug, Clone)]
pub(crate) struct Summary {
    pub(crate) rounds: usize,
    pub(crate) median: Duration,
    pub(crate) mean: Duration,
    pub(crate) p99: Duration,
    pub(crate) min: Duration,
    pub(crate) max: Duration,
}

impl Summary {
    /// # Panics
    ///
    /// When there are no samples: every case runs at least one round.
    pub(crate) fn of(mut samples: Vec<Duration>) -> Self {
        assert!(!samples.is_empty(), "a case ran no round");
        samples.sort_unstable();
        let total: Duration = samples.iter().sum();
        Self {
            rounds: samples.len(),
            median: percentile(&samples, 0.5),
            mean: total / samples.len() as u32,
            p99: percentile(&samples, 0.99),
            min: samples[0],
            max: samples[samples.len() - 1],
        }
    }

    pub(crate) fn to_json(&self) -> Value {
        json!({
            "rounds": self.rounds,
            "median_ms": ms(self.median),
            "mean_ms": ms(self.mean),
            "p99_ms": ms(self.p99),
            "min_ms": ms(self.min),
            "max_ms": ms(self.max),
        })
    }
}

/// The value below which a fraction `p` of the sorted samples lie (nearest rank).
pub(crate) fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let index = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[index]
}

/// Milliseconds, rounded to nanoseconds so the JSON stays readable.
pub(crate) fn ms(duration: Duration) -> f64 {
    round(duration.as_secs_f64() * 1e3, 6)
}

pub(crate) fn round(value: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (value * scale).round() / scale
}

/// A duration for people: `850 µs`, `12.3 ms`, `4.56 s`.
pub(crate) fn human(duration: Duration) -> String {
    let secs = duration.as_secs_f64();
    if secs < 1e-3 {
        format!("{:.0} µs", secs * 1e6)
    } else if secs < 1.0 {
        format!("{:.2} ms", secs * 1e3)
    } else {
        format!("{secs:.2} s")
    }
}

/// A count with thousands separators: `100,000`.
pub(crate) fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}
