//! A small fixed-size thread pool for the CPU backend's data-parallel loops.
//!
//! `parallel_for(n, f)` runs `f(0..n)` on the workers and the calling thread and returns
//! when every index is done. Workers are joined when the pool is dropped, so freeing a
//! context leaves no thread behind. A panic inside `f` is re-raised on the calling thread
//! (where the C boundary's panic guard turns it into a status). Nested or concurrent calls
//! are safe: a call from inside a job runs serially, and concurrent callers take turns.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

type JobFn = dyn Fn(usize) + Sync;

/// A job shared with the workers for the duration of one `parallel_for` call.
struct Job {
    /// Points at a closure that lives on the caller's stack; only dereferenced while the
    /// caller is blocked inside `parallel_for`.
    func: *const JobFn,
    n: usize,
    next: AtomicUsize,
}

// SAFETY: `func` points at a `Sync` closure and is only used while the owning
// `parallel_for` call is blocked waiting for all workers to finish with it.
unsafe impl Send for Job {}
unsafe impl Sync for Job {}

struct State {
    job: Option<Arc<Job>>,
    generation: u64,
    /// Workers still running the current job.
    busy: usize,
    panic: Option<Box<dyn std::any::Any + Send>>,
    shutdown: bool,
}

struct Shared {
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
    /// Serializes concurrent callers.
    turn: Mutex<()>,
}

/// Fixed-size pool; `threads` counts the calling thread, so `threads - 1` workers exist.
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    threads: usize,
}

thread_local! {
    static IN_JOB: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

impl ThreadPool {
    /// Starts a pool of `threads` (≥ 1) threads including the caller's.
    pub fn new(threads: usize) -> std::io::Result<Self> {
        let threads = threads.max(1);
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                job: None,
                generation: 0,
                busy: 0,
                panic: None,
                shutdown: false,
            }),
            work: Condvar::new(),
            done: Condvar::new(),
            turn: Mutex::new(()),
        });
        let mut pool = ThreadPool {
            shared,
            workers: Vec::with_capacity(threads - 1),
            threads,
        };
        for i in 1..threads {
            let shared = Arc::clone(&pool.shared);
            let handle = std::thread::Builder::new()
                .name(format!("kvreplay-cpu-{i}"))
                .spawn(move || worker(shared))?;
            pool.workers.push(handle);
        }
        Ok(pool)
    }

    /// Threads that work on a job, the caller included.
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs `f(i)` for every `i` in `0..n`, spread over the pool; returns when all are done.
    pub fn parallel_for<F: Fn(usize) + Sync>(&self, n: usize, f: F) {
        if n == 0 {
            return;
        }
        if n == 1 || self.workers.is_empty() || IN_JOB.with(|c| c.get()) {
            (0..n).for_each(f);
            return;
        }
        let _turn = self.shared.turn.lock().unwrap_or_else(|e| e.into_inner());
        let func: &(dyn Fn(usize) + Sync + '_) = &f;
        // SAFETY: erase the closure's lifetime; we wait below until no worker holds it.
        let func: *const JobFn =
            unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static JobFn>(func) };
        let job = Arc::new(Job {
            func,
            n,
            next: AtomicUsize::new(0),
        });
        {
            let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.job = Some(Arc::clone(&job));
            st.generation += 1;
            st.busy = self.workers.len();
            st.panic = None;
            self.shared.work.notify_all();
        }
        let mine = catch_unwind(AssertUnwindSafe(|| run_job(&job)));
        let panic = {
            let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            while st.busy > 0 {
                st = self.shared.done.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            st.job = None;
            st.panic.take()
        };
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if let Some(p) = panic {
            resume_unwind(p);
        }
    }
}

fn run_job(job: &Job) {
    IN_JOB.with(|c| c.set(true));
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            IN_JOB.with(|c| c.set(false));
        }
    }
    let _reset = Reset;
    // SAFETY: the caller of parallel_for keeps the closure alive until all workers are done.
    let func = unsafe { &*job.func };
    loop {
        let i = job.next.fetch_add(1, Ordering::Relaxed);
        if i >= job.n {
            break;
        }
        func(i);
    }
}

fn worker(shared: Arc<Shared>) {
    let mut seen = 0u64;
    loop {
        let job = {
            let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if st.shutdown {
                    return;
                }
                if st.generation != seen {
                    if let Some(job) = st.job.clone() {
                        seen = st.generation;
                        break job;
                    }
                }
                st = shared.work.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        };
        let result = catch_unwind(AssertUnwindSafe(|| run_job(&job)));
        drop(job);
        let mut st = shared.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(p) = result {
            if st.panic.is_none() {
                st.panic = Some(p);
            }
        }
        st.busy -= 1;
        if st.busy == 0 {
            shared.done.notify_all();
        }
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        {
            let mut st = self.shared.state.lock().unwrap_or_else(|e| e.into_inner());
            st.shutdown = true;
            self.shared.work.notify_all();
        }
        for handle in self.workers.drain(..) {
            let _ = handle.join();
        }
    }
}

/// Number of hardware threads available to this process (at least 1).
pub fn available_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_index_once() {
        let pool = ThreadPool::new(4).unwrap();
        for n in [0usize, 1, 2, 3, 17, 1000] {
            let hits: Vec<AtomicU64> = (0..n).map(|_| AtomicU64::new(0)).collect();
            pool.parallel_for(n, |i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn nested_and_concurrent_calls() {
        let pool = Arc::new(ThreadPool::new(3).unwrap());
        let total = AtomicU64::new(0);
        pool.parallel_for(8, |_| {
            pool.parallel_for(8, |_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(total.load(Ordering::Relaxed), 64);
        let handles: Vec<_> = (0..4)
            .map(|_| {
                let pool = Arc::clone(&pool);
                std::thread::spawn(move || {
                    let sum = AtomicU64::new(0);
                    pool.parallel_for(100, |i| {
                        sum.fetch_add(i as u64, Ordering::Relaxed);
                    });
                    sum.load(Ordering::Relaxed)
                })
            })
            .collect();
        for h in handles {
            assert_eq!(h.join().unwrap(), 4950);
        }
    }

    #[test]
    fn panic_reaches_the_caller_and_pool_survives() {
        let pool = ThreadPool::new(3).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.parallel_for(64, |i| {
                if i == 37 {
                    panic!("boom");
                }
            })
        }));
        assert!(r.is_err());
        let count = AtomicU64::new(0);
        pool.parallel_for(10, |_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 10);
    }
}
