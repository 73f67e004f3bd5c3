//! The targets, each with the ratio measured for it.

use serde_json::{json, Value};

#[derive(Debug, Clone)]
pub(crate) struct Target {
    name: String,
    goal: Goal,
    measured: Option<f64>,
}

#[derive(Debug, Clone, Copy)]
enum Goal {
    AtMost(f64),
    Below(f64),
    AtLeast(f64),
    Holds,
}

impl Target {
    /// Met when the measured ratio is at most `limit`.
    pub(crate) fn at_most(name: &str, measured: Option<f64>, limit: f64) -> Self {
        Self::new(name, Goal::AtMost(limit), measured)
    }

    /// Met when the measured ratio is less than `limit`.
    pub(crate) fn below(name: &str, measured: Option<f64>, limit: f64) -> Self {
        Self::new(name, Goal::Below(limit), measured)
    }

    /// Met when the measured ratio is at least `limit`.
    pub(crate) fn at_least(name: &str, measured: Option<f64>, limit: f64) -> Self {
        Self::new(name, Goal::AtLeast(limit), measured)
    }

    /// Met when `held` is true.
    pub(crate) fn holds(name: &str, held: bool) -> Self {
        Self::new(name, Goal::Holds, Some(if held { 1.0 } else { 0.0 }))
    }

    fn new(name: &str, goal: Goal, measured: Option<f64>) -> Self {
        Self {
            name: name.to_owned(),
            goal,
            measured: measured.filter(|m| m.is_finite()),
        }
    }

    fn met(&self) -> bool {
        match (self.goal, self.measured) {
            (_, None) => false,
            (Goal::AtMost(limit), Some(m)) => m <= limit,
            (Goal::Below(limit), Some(m)) => m < limit,
            (Goal::AtLeast(limit), Some(m)) => m >= limit,
            (Goal::Holds, Some(m)) => m == 1.0,
        }
    }

    pub(crate) fn to_json(&self) -> Value {
        let goal = match self.goal {
            Goal::AtMost(limit) => format!("<= {limit}"),
            Goal::Below(limit) => format!("< {limit}"),
            Goal::AtLeast(limit) => format!(">= {limit}"),
            Goal::Holds => "yes".to_owned(),
        };
        let measured = match (self.goal, self.measured) {
            (_, None) => Value::Null,
            (Goal::Holds, Some(m)) => json!(if m == 1.0 { "yes" } else { "no" }),
            (_, Some(m)) => json!(crate::stats::round(m, 3)),
        };
        json!({
            "target": self.name,
            "goal": goal,
            "measured": measured,
            "met": self.met(),
        })
    }
}
