//! What the bench is doing, on stderr: the case, how far along it is, and the time spent.
//!
//! On a terminal one line is redrawn in place; otherwise (a log, CI) a line is printed when
//! a case starts and ends, and every few seconds in between.

use std::{
    io::{IsTerminal, Write},
    sync::{LazyLock, Mutex},
    time::{Duration, Instant},
};

use crate::stats::count;

struct State {
    started: Instant,
    tty: bool,
    case: String,
    unit: &'static str,
    planned: u64,
    done: u64,
    last_drawn: Option<Instant>,
}

static STATE: LazyLock<Mutex<State>> = LazyLock::new(|| {
    Mutex::new(State {
        started: Instant::now(),
        tty: std::io::stderr().is_terminal(),
        case: String::new(),
        unit: "rounds",
        planned: 0,
        done: 0,
        last_drawn: None,
    })
});

/// Starts the clock that every line shows.
pub(crate) fn start() {
    LazyLock::force(&STATE);
}

/// A new case: `case` names it (section, its number among the section's cases, what runs);
/// `planned` is how many `unit`s it means to run, at most.
pub(crate) fn begin(case: String, unit: &'static str, planned: u64) {
    let mut state = STATE.lock().unwrap();
    state.case = case;
    state.unit = unit;
    state.planned = planned;
    state.done = 0;
    state.last_drawn = None;
    state.draw("", true);
}

/// Revises the plan of the running case, once its first rounds have shown their cost.
pub(crate) fn replan(planned: u64) {
    STATE.lock().unwrap().planned = planned;
}

/// `done` units of the running case are finished.
pub(crate) fn tick(done: u64) {
    let mut state = STATE.lock().unwrap();
    state.done = done;
    state.draw("", false);
}

/// How far along the running unit is, for units that take long (a round of 100,000 round
/// trips).
pub(crate) fn within(part: u64, of: u64, what: &str) {
    let detail = format!(" (this one: {}/{} {what})", count(part), count(of));
    STATE.lock().unwrap().draw(&detail, false);
}

/// The running case is over; `outcome` is its headline figure.
pub(crate) fn end(outcome: &str) {
    let mut state = STATE.lock().unwrap();
    let line = format!("{} {}: {outcome}", state.clock(), state.case);
    let mut stderr = std::io::stderr().lock();
    if state.tty {
        let _ = writeln!(stderr, "\r\x1b[2K{line}");
    } else {
        let _ = writeln!(stderr, "{line}");
    }
    state.last_drawn = None;
}

/// A line of its own, between cases.
pub(crate) fn note(message: &str) {
    let state = STATE.lock().unwrap();
    let prefix = if state.tty { "\r\x1b[2K" } else { "" };
    eprintln!("{prefix}{} {message}", state.clock());
}

impl State {
    fn clock(&self) -> String {
        let secs = self.started.elapsed().as_secs();
        format!("[{:02}:{:02}]", secs / 60, secs % 60)
    }

    fn draw(&mut self, detail: &str, force: bool) {
        let every = if self.tty {
            Duration::from_millis(100)
        } else {
            Duration::from_secs(5)
        };
        let now = Instant::now();
        if !force && self.last_drawn.is_some_and(|at| now - at < every) {
            return;
        }
        self.last_drawn = Some(now);
        let line = format!(
            "{} {}: {}/{} {}{detail}",
            self.clock(),
            self.case,
            self.done,
            self.planned,
            self.unit
        );
        let mut stderr = std::io::stderr().lock();
        if self.tty {
            let _ = write!(stderr, "\r\x1b[2K{line}");
            let _ = stderr.flush();
        } else {
            let _ = writeln!(stderr, "{line}");
        }
    }
}
