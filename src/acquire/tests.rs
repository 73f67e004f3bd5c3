use std::sync::Mutex;

use super::*;
use crate::store::{
    contract::{Keys, Mode, Reply},
    handle::Store,
    late,
    memory::{
        intercept::{exclusive, Hooks, Intercepted},
        MemoryStore,
    },
};

/// Locks over `store`; idempotent answers, which these tests do not use, in memory.
fn locks_over(store: Arc<dyn LockStore>) -> Locks {
    Locks::new(Store {
        locks: store,
        #[cfg(feature = "idempotency")]
        answers: Arc::new(MemoryStore::new()),
    })
}

/// Takes `keys` in `store` for another owner, for `ttl`: whose hold it gives.
async fn held_by_another(store: &MemoryStore, keys: &Arc<[String]>, ttl: Duration) -> Holder {
    let holder = Holder::new(OwnerToken::random());
    let held = store
        .acquire(&exclusive(keys.clone(), holder, ttl))
        .await
        .unwrap();
    assert!(matches!(held, Acquire::Granted(_)));
    holder
}

/// Releases `holder`'s keys during the waiter's second attempt, after the store found
/// them held and before the attempt's answer comes back; notes on tokio's clock when
/// each attempt started and ended.
#[derive(Debug)]
struct ReleaseDuringSecondAttempt {
    holder: Mutex<Option<(Keys, Holder)>>,
    attempts: Mutex<Vec<(tokio::time::Instant, tokio::time::Instant)>>,
}

impl Hooks for ReleaseDuringSecondAttempt {
    fn acquire<'a>(
        &'a self,
        store: &'a MemoryStore,
        request: &'a AcquireRequest,
    ) -> Reply<'a, Acquire> {
        Box::pin(async move {
            let started = tokio::time::Instant::now();
            let answer = store.acquire(request).await;
            if self.attempts.lock().unwrap().len() == 1 {
                let (keys, holder) = self.holder.lock().unwrap().take().unwrap();
                assert_eq!(store.release(&keys, holder).await.unwrap(), 1);
            }
            let ended = tokio::time::Instant::now();
            self.attempts.lock().unwrap().push((started, ended));
            answer
        })
    }
}

/// On tokio's paused clock, time moves only when every task waits for a timer: a
/// waiter that tries again at once leaves it where it was, one that pauses moves it.
#[tokio::test(start_paused = true)]
async fn a_release_during_an_attempt_wakes_the_waiter_at_once() {
    let hooks = ReleaseDuringSecondAttempt {
        holder: Mutex::new(None),
        attempts: Mutex::new(Vec::new()),
    };
    let store = Arc::new(Intercepted::new(hooks));
    let keys: Arc<[String]> = vec!["lock:a".to_owned()].into();
    let holder = held_by_another(&store.store, &keys, Duration::from_secs(30)).await;
    *store.hooks.holder.lock().unwrap() = Some((keys.clone(), holder));

    let locks = locks_over(store.clone()).wait(Wait::up_to(Duration::from_secs(1)));
    let modes = Modes::All(Mode::Exclusive);
    let acquisition = Acquisition::new(&locks, &keys, &modes, None, None);
    let granted = acquisition.run(OwnerToken::random(), Instant::now()).await;
    assert!(granted.is_ok(), "the waiter was not granted");
    // Refused; after a pause, refused with the key released meanwhile; then, at once,
    // granted. A waiter that missed the release would pause again first.
    let attempts = store.hooks.attempts.lock().unwrap().clone();
    assert_eq!(attempts.len(), 3);
    assert!(
        attempts[1].0 > attempts[0].1,
        "no pause after the first refusal"
    );
    let between = attempts[2].0 - attempts[1].1;
    assert_eq!(
        between,
        Duration::ZERO,
        "paused {between:?} after the release"
    );
}

/// Grants only `delay` after the attempt was sent, and answers at once: as the last step of
/// a batch granted in steps (or the last group on a cluster), whose first keys were set
/// when the attempt began.
#[derive(Debug)]
struct AnswerLate {
    delay: Duration,
}

impl Hooks for AnswerLate {
    fn acquire<'a>(
        &'a self,
        store: &'a MemoryStore,
        request: &'a AcquireRequest,
    ) -> Reply<'a, Acquire> {
        Box::pin(async move {
            tokio::time::sleep(self.delay).await;
            store.acquire(request).await
        })
    }
}

/// A grant answered after the TTL counted from its attempt is no grant: another request
/// may hold its first keys by then. The request gets 503, and the keys are released.
#[tokio::test]
async fn a_grant_answered_after_its_ttl_is_released_and_refused() {
    let ttl = Duration::from_millis(50);
    let store = Arc::new(Intercepted::new(AnswerLate { delay: ttl * 2 }));
    let locks = locks_over(store.clone()).ttl(ttl);
    let keys: Arc<[String]> = vec!["lock:a".to_owned(), "lock:b".to_owned()].into();
    let modes = Modes::All(Mode::Exclusive);
    let acquisition = Acquisition::new(&locks, &keys, &modes, None, None);
    let refused = acquisition.run(OwnerToken::random(), Instant::now()).await;
    assert!(
        matches!(refused, Err(Refusal::Unavailable)),
        "granted after its TTL"
    );

    // Released at once, not left to expire: the keys, granted just now, are free well
    // within their TTL.
    tokio::time::sleep(Duration::from_millis(5)).await;
    for view in store.store.inspect(&keys).await.unwrap() {
        assert_eq!(view.holds, 0, "a key is still held: {view:?}");
    }

    // A store that answers within the TTL grants as before.
    let store = Arc::new(Intercepted::new(AnswerLate { delay: ttl / 5 }));
    let locks = locks_over(store).ttl(ttl);
    let acquisition = Acquisition::new(&locks, &keys, &modes, None, None);
    assert!(acquisition
        .run(OwnerToken::random(), Instant::now())
        .await
        .is_ok());
}

/// Withdraws only `delay` after it was asked to, the first time.
#[derive(Debug)]
struct FirstWithdrawalLate {
    delay: Duration,
    asked: std::sync::atomic::AtomicBool,
}

impl Hooks for FirstWithdrawalLate {
    fn withdraw<'a>(
        &'a self,
        store: &'a MemoryStore,
        keys: &'a Keys,
        ticket: Ticket,
    ) -> Reply<'a, usize> {
        Box::pin(async move {
            if !self.asked.swap(true, std::sync::atomic::Ordering::SeqCst) {
                tokio::time::sleep(self.delay).await;
            }
            store.withdraw(keys, ticket).await
        })
    }
}

/// A waiter dropped while its withdrawal is under way (it gave up, and its client's
/// timeout came before the store answered) still withdraws its place, in the background:
/// dropped, its reservations kept every later request out until its deadline.
#[tokio::test(start_paused = true)]
async fn a_waiter_dropped_during_its_withdrawal_withdraws_in_the_background() {
    let store = Arc::new(Intercepted::new(FirstWithdrawalLate {
        delay: Duration::from_secs(2),
        asked: false.into(),
    }));
    let keys: Arc<[String]> = vec!["lock:a".to_owned()].into();
    held_by_another(&store.store, &keys, Duration::from_secs(30)).await;

    // It waits 1 s, reserving the key until 1.5 s, gives up, and is dropped at 1.1 s,
    // while its withdrawal waits on the store.
    let locks = locks_over(store.clone()).wait(Wait::up_to(Duration::from_secs(1)));
    let modes = Modes::All(Mode::Exclusive);
    let acquisition = Acquisition::new(&locks, &keys, &modes, None, None);
    let run = acquisition.run(OwnerToken::random(), Instant::now());
    assert!(tokio::time::timeout(Duration::from_millis(1_100), run)
        .await
        .is_err());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let view = &store.store.inspect(&keys).await.unwrap()[0];
    assert_eq!(view.waiters, 0, "its place is still there: {view:?}");
}

/// Counts the acquisitions it passes on.
#[derive(Debug, Default)]
struct CountAttempts(std::sync::atomic::AtomicUsize);

impl CountAttempts {
    fn seen(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Hooks for CountAttempts {
    fn acquire<'a>(
        &'a self,
        store: &'a MemoryStore,
        request: &'a AcquireRequest,
    ) -> Reply<'a, Acquire> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        store.acquire(request)
    }
}

/// A store that counts attempts, and its key `lock:a` held by another owner for `ttl`:
/// the store, the key, and the hold.
async fn one_key_held_for(ttl: Duration) -> (Arc<Intercepted<CountAttempts>>, Keys, Holder) {
    let store = Arc::new(Intercepted::new(CountAttempts::default()));
    let keys: Keys = vec!["lock:a".to_owned()].into();
    let holder = held_by_another(&store.store, &keys, ttl).await;
    (store, keys, holder)
}

/// Runs a fair waiter of `keys` that waits up to 3 s on `store`, from now: when it was
/// granted.
async fn wait_in_line(store: Arc<Intercepted<CountAttempts>>, keys: &Arc<[String]>) -> Instant {
    let locks = locks_over(store).wait(Wait::up_to(Duration::from_secs(3)));
    let modes = Modes::All(Mode::Exclusive);
    let acquisition = Acquisition::new(&locks, keys, &modes, None, None);
    let granted = acquisition.run(OwnerToken::random(), Instant::now()).await;
    assert!(granted.is_ok(), "the waiter was not granted");
    Instant::now()
}

/// A waiter in line is told when its turn comes: while the hold before it lasts, polls
/// would only cost the store a call each (at 100-200 ms they did, a refused attempt
/// here, and a hot key's waiters made one a grant); it looks only every 1-2 s.
#[tokio::test]
async fn a_waiter_in_line_does_not_poll_a_hold_that_is_released() {
    let (store, keys, holder) = one_key_held_for(Duration::from_secs(30)).await;
    let releasing = store.clone();
    let releases = keys.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(releasing.store.release(&releases, holder).await.unwrap(), 1);
    });
    wait_in_line(store.clone(), &keys).await;
    // Refused, then woken by the release and granted.
    assert_eq!(store.hooks.seen(), 2);
}

/// A hold that nobody releases (its process died) ends unannounced: the waiter in line
/// looks again when it ends, as its refusal said, and is granted then, not at the next
/// poll of a backoff (700-1,400 ms here, then 1,500-3,000 ms).
#[tokio::test]
async fn a_waiter_in_line_tries_again_when_the_hold_before_it_ends() {
    let ttl = Duration::from_millis(800);
    let held = Instant::now();
    let (store, keys, _) = one_key_held_for(ttl).await;
    let granted = wait_in_line(store.clone(), &keys).await - held;
    assert_eq!(
        store.hooks.seen(),
        2,
        "refused, then granted as the hold ended"
    );
    assert!(
        granted >= ttl && granted < ttl + Duration::from_millis(300),
        "granted {granted:?} after the hold began, which ended after {ttl:?}"
    );
}

/// The same behind a hold that ends after the backoff reached its longest pauses: the
/// waiter looks every 1-2 s, and then when the hold ends, where a pause of 1-2 s could
/// have taken it up to 2 s past the end (0.4-0.8 s with the backoff as a floor).
#[tokio::test]
async fn a_waiter_in_line_behind_a_long_hold_is_granted_as_it_ends() {
    let ttl = Duration::from_millis(2_500);
    let held = Instant::now();
    let (store, keys, _) = one_key_held_for(ttl).await;
    let granted = wait_in_line(store.clone(), &keys).await - held;
    assert!(
        granted >= ttl && granted < ttl + Duration::from_millis(150),
        "granted {granted:?} after the hold began, which ended after {ttl:?}"
    );
    // Refused, then one or two looks before the end, then granted.
    assert!(
        (3..=4).contains(&store.hooks.seen()),
        "{}",
        store.hooks.seen()
    );
}

/// Refuses as the store does, its refusals saying (or not) that a part of the attempt may
/// still reserve the batch later; counts the withdrawals.
#[derive(Debug)]
struct RefusalsWithStrays {
    strays: bool,
    withdrawals: std::sync::atomic::AtomicUsize,
}

impl Hooks for RefusalsWithStrays {
    fn acquire<'a>(
        &'a self,
        store: &'a MemoryStore,
        request: &'a AcquireRequest,
    ) -> Reply<'a, Acquire> {
        Box::pin(async move {
            match store.acquire(request).await? {
                Acquire::Held(mut contention) => {
                    contention.may_reserve_later = self.strays;
                    Ok(Acquire::Held(contention))
                }
                granted => Ok(granted),
            }
        })
    }

    fn withdraw<'a>(
        &'a self,
        store: &'a MemoryStore,
        keys: &'a Keys,
        ticket: Ticket,
    ) -> Reply<'a, usize> {
        self.withdrawals
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        store.withdraw(keys, ticket)
    }
}

/// A refusal that says a part of it may still reserve the batch later (a Redlock master,
/// or a cluster group's reservation, that gave no answer) has the grant that ends the wait
/// send the waiter's withdrawal again on `late`'s schedule, where that part, landing, would
/// keep its place to the waiter's deadline; a refusal answered whole, none.
#[tokio::test(start_paused = true)]
async fn a_grant_after_a_refusal_that_may_reserve_later_withdraws_again() {
    for (strays, withdrawals) in [(true, late::AFTER.len()), (false, 0)] {
        let store = Arc::new(Intercepted::new(RefusalsWithStrays {
            strays,
            withdrawals: 0.into(),
        }));
        let keys: Keys = vec!["lock:a".to_owned()].into();
        held_by_another(&store.store, &keys, Duration::from_millis(500)).await;
        let locks = locks_over(store.clone()).wait(Wait::up_to(Duration::from_secs(3)));
        let modes = Modes::All(Mode::Exclusive);
        let acquisition = Acquisition::new(&locks, &keys, &modes, None, None);
        let granted = acquisition.run(OwnerToken::random(), Instant::now()).await;
        assert!(granted.is_ok(), "the waiter was not granted");
        tokio::time::sleep(late::AFTER.iter().sum::<Duration>() + Duration::from_secs(1)).await;
        let sent = store
            .hooks
            .withdrawals
            .load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(sent, withdrawals, "strays: {strays}");
    }
}
