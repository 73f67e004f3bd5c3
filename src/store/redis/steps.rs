//! How a batch goes to Redis: the free keys of a big batch with plain commands, the rest
//! in steps.
//!
//! **Free keys.** A command called from a script costs Redis more than the same command
//! sent on its own (`SET key value PX ttl NX` for 1,000 keys: 1.7 µs a key in a script
//! against 0.5 µs plain, in `INFO commandstats`; 0.6 µs a key less in Redis's CPU time,
//! `INFO cpu`, which also counts reading and parsing), and the common key of a big batch
//! is a free one, which a script would only `SET`. So an exclusive batch of [`PLAIN_FROM`] keys
//! or more first sends that `SET` for every key, pipelined: a key that was free is taken
//! as the script would take it (the same value, the same ttl), and whatever was there
//! instead (a hold, a reservation, a foreign value) makes the key one for the script,
//! which needs to read it. The plain pass is as good as the first step of the batch:
//! others see its keys held, and only the last step counts the grant. A free key may yet
//! be one that a waiter's claim names (`claims.lua`), which a plain `SET` cannot see: the
//! pass ends with a read of the claims' registry, and where a claim with an earlier ticket
//! than the caller's is there (any claim, for a caller in no line), the pass gives its keys
//! back and the script looks at every key of the batch (it would take the pass's holds for
//! ones the owner held before, which no claim keeps it out of). Redis runs a
//! client's pipeline a read buffer at a time, between other clients' commands, so that it
//! keeps no one waiting for long either.
//!
//! **Under contention** the plain pass is left out. A batch that the script refuses shows
//! no one anything; one whose plain pass took its free keys before a held one refused it
//! kept them from others for a round trip or two, and gives them back. Amid orders that
//! keep meeting each other and retrying, that starved them: with a plain pass on every
//! attempt, 47-71 of 270 retail orders and 5 of 30 purchase orders got through where the
//! script alone let every one through (the test
//! `purchase_orders_amid_retail_orders_all_get_through`). So for a moment after a store
//! refused a batch, its big batches go to the script alone (`store/refusals.rs`), but for a
//! waiter's retry whose place in line is a claim: the claim already keeps every later
//! arrival and every request in no line out of its free keys, so its pass keeps out no one
//! else but an owner that came earlier (for the round trip the pass lasts), and the script
//! that would take the keys instead costs Redis three to five times as much a key. Amid
//! 16 retail and 4 purchase clients on one Redis that took Redis's CPU time a grant from
//! 3.8 ms to 3.0, and the grants from 0.37 to 0.44 of the memory store's. And a waiter's
//! first attempt at a big exclusive batch then probes its first keys, and, kept out,
//! joins the line with its claim alone ([`RedisStore::join_line`]), where the script
//! would read and count every key only to refuse it.
//!
//! **Steps** (bounded stall, DESIGN.md property 12): the keys left for the script go to
//! Redis in steps of at most [`RedisStore::with_step`] keys, so that no one script keeps
//! Redis from its other clients for longer than a step takes, whatever the batch. An
//! acquisition takes its steps in key order. The keys of a granted step stay held while
//! the next ones are tried (others see them held, as they would a moment later), and only
//! the last step counts the grant: no fencing token, and so no grant, before every step
//! succeeded. A step that is refused ends the attempt: the keys taken before it are
//! released, and a waiter in line first reserves every key of its batch, so that its place
//! in line holds for the whole batch, as it does for a batch taken in one step. Reserving
//! the steps it did not try reads their keys: the refusal names what keeps the waiter out
//! there too, so that it [probes](crate::store::contract::LockStore::probe) every blocker
//! before it tries again, rather than take its first steps again only to be refused at a
//! later one. Keys are sorted, so two batches in steps meet in the same order and never
//! hold out for each other. Two plain passes at once may each take part of what both
//! want: then both are refused and undone, and waiters in line go in their order.

use std::{ops::Range, time::Duration};

use redis::{FromRedisValue, Value};

use super::{
    super::{
        contract::{
            Acquire, AcquireRequest, Contention, FencingToken, Keys, Line, LockStore, Ticket,
        },
        error::StoreError,
    },
    connection::Command,
    line_arg, millis, Freeing, RedisStore, FIRST_PROBE,
};

/// The smallest batch whose free keys are taken with plain commands. That costs a round
/// trip more than a script alone, and saves about 0.6 µs of Redis's CPU time a key: below
/// a few dozen keys the round trip costs the request more than Redis saves.
pub(super) const PLAIN_FROM: usize = 64;

/// The smallest batch whose waiter keeps its place in line with a claim (`claims.lua`)
/// rather than with a reservation in each key: where rewriting every key to wait, and
/// again to be granted and released, costs Redis more than a claim's one set and the look
/// that every acquisition and release takes at the live claims (one command a claim).
pub(super) const CLAIM_FROM: usize = 64;

impl RedisStore {
    /// Acquires a batch: its free keys first with plain commands where that pays (see the
    /// module docs), then the rest with the script, in steps where they are more than one.
    pub(super) async fn acquire_batch(
        &self,
        request: &AcquireRequest,
    ) -> Result<Acquire, StoreError> {
        let claim = matches!(request.line, Line::At(_)) && self.claims(request.keys.len());
        let answer = self.acquire_free_first(request, claim).await;
        self.last_refusal.note(&answer);
        answer
    }

    /// [`acquire_batch`](Self::acquire_batch)'s work: the plain pass, unless the batch is
    /// small, shared, waits for replicas, is a waiter's retry with its reservations in the
    /// keys (a plain `SET NX` would take none, and cost Redis a command a key), or the
    /// store refused a batch a moment ago and this is not a claim's retry.
    async fn acquire_free_first(
        &self,
        request: &AcquireRequest,
        claim: bool,
    ) -> Result<Acquire, StoreError> {
        // A claim's retry takes only keys its claim keeps everyone else out of already:
        // its pass starves no one, and saves most of what its grant costs Redis.
        let claims_retry = claim && request.retry;
        let exclusive = request.modes.shared(request.keys.len()) == 0;
        let refused_lately = self.last_refusal.recent();
        let plain = request.keys.len() >= PLAIN_FROM
            && (!request.retry || claims_retry)
            && exclusive
            // With replicas to wait for, every write of the grant goes through its `WAIT`.
            && self.replicas.is_none()
            && (claims_retry || !refused_lately);
        if !plain {
            // A waiter's first attempt amid refusals (not every first attempt on a store
            // with replicas, which skips the pass for another reason).
            let arrival = claim && !request.retry && exclusive && refused_lately;
            if let (Line::At(ticket), true) = (request.line, arrival) {
                if let Some(held) = self.join_line(request, ticket).await? {
                    return Ok(Acquire::Held(held));
                }
            }
            return self.acquire_in_steps(request, Taken::NONE, claim).await;
        }
        let (found, refusal, claimed) = self.take_free(request).await?;
        let taken = Taken {
            batch: &request.keys,
            found: &found,
        };
        if let Some(error) = refusal {
            // The caller releases the batch, as after any failure that may have taken keys
            // (a cluster store on the keys' new masters, where a slot moved).
            return Err(error.context(format!(
                "taking the free keys of a batch ({} taken)",
                taken.len()
            )));
        }
        if claimed {
            // An earlier waiter's claim may name a key the pass took, which the script
            // would take for one its owner held already: the pass gives its keys back, and
            // the script looks at every key.
            let held: Vec<String> = taken.keys().cloned().collect();
            self.free(Freeing::Release(request.holder), &held)
                .await
                .map_err(|error| {
                    StoreError::unknown(error)
                        .context("a claim was live: giving back the plain pass's keys failed")
                })?;
            return self.acquire_in_steps(request, Taken::NONE, claim).await;
        }
        if found.is_empty() && !self.scripts.counts_grants() && !claim {
            // Every key was free, and a cluster node has no grant to count; a claim's
            // grant goes on to an empty step, which ends the claim.
            return Ok(Acquire::Granted(FencingToken::new(0)));
        }
        self.acquire_in_steps(&request.of(&found), taken, claim)
            .await
    }

    /// A waiter's first attempt at a big exclusive batch while the store refuses batches:
    /// most are refused, and a refused attempt reads every key (to count and name what
    /// keeps it out) before it claims the batch, where a probe of the first keys finds one
    /// held, and the claim needs no read at all. So it probes its first 64 keys; kept
    /// out, it joins the line with its claim alone (`join_line.lua`, whose call that
    /// completes the claim looks again at the key the probe found: freed since, by a
    /// release that woke no one, the batch is tried now). Amid 16 retail and 4 purchase
    /// clients on one Redis, that
    /// took a purchase order's arrival from two scripts over 2,000 keys (2.9 ms of Redis's
    /// time) to a probe of its first keys and a claim: Redis's time a grant fell by a
    /// seventh on average (six A/B pairs of runs; by 14-16% on Redlock and a cluster, two
    /// pairs), the grants stayed within the noise of the runs.
    ///
    /// The refusal names the keys from the one found held on (those the waiter probes
    /// before it tries again), and counts that one alone ([`Contention::counted`]).
    async fn join_line(
        &self,
        request: &AcquireRequest,
        ticket: Ticket,
    ) -> Result<Option<Contention>, StoreError> {
        let keys = &request.keys;
        // Its first keys alone: a batch that they do not keep out is tried whole at once.
        let first: Vec<usize> = (0..FIRST_PROBE.min(self.step).min(keys.len())).collect();
        let free = self.probe(&request.of(&first)).await?;
        let Some(found) = first.get(free).map(|&i| &keys[i]) else {
            return Ok(None);
        };
        let steps: Vec<&[String]> = keys.chunks(self.step).collect();
        let mut ends_in: i64 = -1;
        for (n, step) in steps.iter().enumerate() {
            let last = n + 1 == steps.len();
            // The last call looks at the key found held, one more key of its call when it
            // is in an earlier step (claimed twice: the claim is a set).
            let with_found;
            let (call_keys, at) = match (last, step.binary_search(found)) {
                (false, _) => (*step, 0),
                (true, Ok(i)) => (*step, i + 1),
                (true, Err(_)) => {
                    with_found = [*step, std::slice::from_ref(found)].concat();
                    (&with_found[..], with_found.len())
                }
            };
            let mut script = self.prepare(&self.scripts.join_line, None, call_keys);
            script
                .arg(request.holder.owner.as_hex())
                .arg(ticket.as_arg())
                .arg(millis(request.reserve))
                .arg(at);
            ends_in = self.invoke(&script).await?;
        }
        // The key found held was freed since the probe: the batch is tried now.
        if ends_in == -2 {
            return Ok(None);
        }
        Ok(Some(Contention {
            keys: keys[free..].iter().take(request.report).cloned().collect(),
            total: 1,
            earliest_expiry: u64::try_from(ends_in).ok().map(Duration::from_millis),
            upgrade: false,
            may_reserve_later: false,
            counted: false,
        }))
    }

    /// Whether a waiter in line with a batch of `keys` keeps its place with a claim
    /// (`claims.lua`) rather than with a reservation in each key.
    pub(crate) fn claims(&self, keys: usize) -> bool {
        keys >= CLAIM_FROM
    }

    /// Sends `SET key value PX ttl NX` for every key of `request`, pipelined. Returns the
    /// indices of the keys it did not take, in order (a key of another type among them:
    /// the script finds it foreign), the first refusal of a `SET`, if any (Redis out of
    /// memory, a read-only replica; on a cluster node, a key of a slot it does not serve),
    /// which fails the acquisition, and whether a claim that keeps the caller out may have
    /// been live once the `SET`s were done: one with an earlier ticket than the caller's
    /// (any, for a caller in no line), ended or not. A claim that ended before then cannot
    /// have been passed: its waiter was not granted while this pass held a key it claimed.
    async fn take_free(
        &self,
        request: &AcquireRequest,
    ) -> Result<(Vec<usize>, Option<StoreError>, bool), StoreError> {
        let value = format!(
            "{}:{}",
            request.holder.owner.as_hex(),
            request.holder.hold_hex()
        );
        let ttl = millis(request.ttl);
        let mut pipeline = redis::pipe();
        pipeline.ignore_errors();
        for key in request.keys.iter() {
            pipeline
                .cmd("SET")
                .arg(key)
                .arg(&value)
                .arg("PX")
                .arg(ttl)
                .arg("NX");
        }
        pipeline
            .cmd("ZRANGE")
            .arg(&**self.claims_registry())
            .arg(0)
            .arg(-1);
        let mut replies: Vec<Value> = self.connection.send(Command::Pipeline(&pipeline)).await?;
        let claimed = {
            // Tickets are strings of digits, all of one length: they compare as strings.
            let mine = line_arg(request.line);
            let earlier = |ticket: &String| mine.is_empty() || *ticket < mine;
            match replies.pop().map(Vec::<String>::from_redis_value) {
                Some(Ok(tickets)) => tickets.iter().any(earlier),
                _ => true,
            }
        };
        let (mut found, mut refusal) = (Vec::new(), None);
        for (i, reply) in replies.into_iter().enumerate() {
            match reply {
                Value::Okay => continue,
                Value::Nil => {}
                // The `RedisError` stays the source, for a cluster store to read a moved
                // slot in it.
                Value::ServerError(error) => {
                    refusal
                        .get_or_insert_with(|| StoreError::unknown(redis::RedisError::from(error)));
                }
                other => {
                    refusal.get_or_insert_with(|| {
                        StoreError::unknown(format!("SET answered {other:?}"))
                    });
                }
            }
            found.push(i);
        }
        Ok((found, refusal, claimed))
    }

    /// Acquires `request` a step at a time (see the module docs), after the keys `taken`,
    /// which this acquisition already holds. With no key left, one empty step counts the
    /// grant.
    async fn acquire_in_steps(
        &self,
        request: &AcquireRequest,
        taken: Taken<'_>,
        claim: bool,
    ) -> Result<Acquire, StoreError> {
        let total = request.keys.len();
        let mut done = 0;
        // Ends with the last step's answer, or with a refusal or failure before it.
        loop {
            let step = done..(done + self.step).min(total);
            let last = step.end == total;
            // A batch of one step goes as it is; a part of one is a request of its own.
            let part;
            let part = if step.len() == total {
                request
            } else {
                part = request.of(&step.clone().collect::<Vec<_>>());
                &part
            };
            match self.acquire_step(part, last, claim).await {
                Ok(Acquire::Granted(fence)) if last => return Ok(Acquire::Granted(fence)),
                Ok(Acquire::Granted(_)) => done = step.end,
                // If the undo fails, the caller releases the whole batch, as after any
                // failure that may have left keys behind.
                Ok(Acquire::Held(mut contention)) => {
                    let later = self
                        .undo(request, taken, step.clone(), claim)
                        .await
                        .map_err(|error| {
                            StoreError::unknown(error).context(
                                "a step was refused, and undoing the steps before it failed",
                            )
                        })?;
                    // The waiter learns of what keeps it out in the steps it did not try
                    // too, so that it probes those before it tries again, rather than
                    // take the steps before them again only to be refused there.
                    contention.total += later.len();
                    let room = request.report.saturating_sub(contention.keys.len());
                    let named = later.iter().take(room);
                    // (A position past the batch, which only a broken reply could give,
                    // names nothing.)
                    let key = |&i: &usize| request.keys.get(step.end + i).cloned();
                    contention.keys.extend(named.filter_map(key));
                    return Ok(Acquire::Held(contention));
                }
                Err(error) if done == 0 && taken.is_empty() => return Err(error),
                Err(error) => {
                    let held = taken.len() + done;
                    return Err(StoreError::unknown(error).context(format!(
                        "a step failed after {held} keys of the batch were taken"
                    )));
                }
            }
        }
    }

    /// Undoes what an acquisition took before the step `refused` of `request`: the keys
    /// `taken` before its steps and the steps before `refused`. A waiter in line first
    /// reserves the keys of every other step (the refused step's script reserved its own),
    /// so that they are never free of both in between. Returns the positions, after the
    /// refused step, of the keys that keep the waiter out (see [`reserve`](Self::reserve)).
    async fn undo(
        &self,
        request: &AcquireRequest,
        taken: Taken<'_>,
        refused: Range<usize>,
        claim: bool,
    ) -> Result<Vec<usize>, StoreError> {
        let held: Keys = taken
            .keys()
            .chain(&request.keys[..refused.start])
            .cloned()
            .collect();
        let (mut later, mut how) = (Vec::new(), Freeing::Release(request.holder));
        if let Line::At(ticket) = request.line {
            self.reserve(&held, ticket, request.reserve, claim).await?;
            later = self
                .reserve(&request.keys[refused.end..], ticket, request.reserve, claim)
                .await?;
            how = Freeing::RollBack(request.holder, ticket);
        }
        if !held.is_empty() {
            self.free(how, &held).await?;
        }
        Ok(later)
    }
}

/// The keys of a batch that a plain pass took (see the module docs): all but the `found`
/// ones, which are left for the script. Listed only if a step is refused, to undo them.
#[derive(Clone, Copy)]
struct Taken<'a> {
    batch: &'a [String],
    /// Indices into `batch`, in order.
    found: &'a [usize],
}

impl<'a> Taken<'a> {
    /// No key taken before the steps.
    const NONE: Self = Self {
        batch: &[],
        found: &[],
    };

    fn len(self) -> usize {
        self.batch.len() - self.found.len()
    }

    fn is_empty(self) -> bool {
        self.len() == 0
    }

    fn keys(self) -> impl Iterator<Item = &'a String> {
        let mut found = self.found.iter().copied().peekable();
        self.batch
            .iter()
            .enumerate()
            .filter(move |(i, _)| found.next_if_eq(i).is_none())
            .map(|(_, key)| key)
    }
}
