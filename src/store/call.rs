//! A call to a store, bounded by the store's timeout.

use std::{future::Future, pin::pin, task::Poll, time::Duration};

use tokio::time::error::Elapsed;

/// `future`'s output, or [`Elapsed`] once `limit` has passed: [`tokio::time::timeout`],
/// except that the timer starts only if the first poll leaves the future pending. The
/// memory store answers on its first poll, and a timer for each of its calls would read
/// the clock and touch the runtime's timer for nothing, twice a request.
pub(crate) async fn within<F: Future>(limit: Duration, future: F) -> Result<F::Output, Elapsed> {
    let mut future = pin!(future);
    let first = std::future::poll_fn(|cx| Poll::Ready(future.as_mut().poll(cx))).await;
    match first {
        Poll::Ready(output) => Ok(output),
        Poll::Pending => tokio::time::timeout(limit, future).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_at_once_needs_no_timer() {
        // Without the time driver, a timer panics: this runtime only serves calls that
        // never start one.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime");
        let answer = runtime.block_on(within(Duration::ZERO, async { 7 }));
        assert_eq!(answer.ok(), Some(7));
    }

    #[tokio::test]
    async fn a_call_that_does_not_answer_ends_at_the_limit() {
        let started = std::time::Instant::now();
        let answer = within(Duration::from_millis(50), std::future::pending::<()>()).await;
        assert!(answer.is_err());
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(50) && took < Duration::from_secs(2),
            "{took:?}"
        );
    }

    #[tokio::test]
    async fn a_call_that_answers_later_is_waited_for() {
        let late = async {
            tokio::time::sleep(Duration::from_millis(20)).await;
            "late"
        };
        assert_eq!(
            within(Duration::from_secs(5), late).await.ok(),
            Some("late")
        );
    }
}
