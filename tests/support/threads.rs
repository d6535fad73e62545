//! Ranks on threads of one process: a small shared-memory collective (sums in rank order,
//! so every rank gets the same bits) through which the tests run several trainers as the
//! ranks of one data-parallel run, without MPI.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use burn::tensor::{Tensor, TensorData};
use flashover::core::collective::Collective;
use flashover::core::error::{CoreError, Result};
use flashover::core::setup::{InnerBackendOf, Setup};
use flashover::core::state::World;

/// Where the ranks of one process meet: each deposits a buffer, the last to arrive releases
/// them all, and every rank reads every buffer. A rank that waits longer than the timeout
/// gets an error naming the ranks that never came.
pub struct Hub {
    size: usize,
    state: Mutex<HubState>,
    arrived_cv: Condvar,
}

struct HubState {
    generation: u64,
    slots: Vec<Option<Vec<f64>>>,
    result: Vec<Vec<f64>>,
}

impl Hub {
    /// A meeting place for `size` ranks.
    pub fn new(size: usize) -> Arc<Hub> {
        Arc::new(Hub {
            size,
            state: Mutex::new(HubState {
                generation: 0,
                slots: vec![None; size],
                result: Vec::new(),
            }),
            arrived_cv: Condvar::new(),
        })
    }

    fn exchange(&self, rank: usize, data: Vec<f64>) -> Result<Vec<Vec<f64>>> {
        let mut s = self.state.lock().unwrap();
        let generation = s.generation;
        s.slots[rank] = Some(data);
        if s.slots.iter().all(Option::is_some) {
            s.result = s
                .slots
                .iter_mut()
                .map(|x| x.take().unwrap_or_default())
                .collect();
            s.generation += 1;
            self.arrived_cv.notify_all();
            return Ok(s.result.clone());
        }
        let (s, timeout) = self
            .arrived_cv
            .wait_timeout_while(s, Duration::from_secs(120), |s| s.generation == generation)
            .unwrap();
        if timeout.timed_out() {
            let missing: Vec<usize> = (0..self.size).filter(|&r| s.slots[r].is_none()).collect();
            return Err(CoreError::Component {
                component: "thread_collective".into(),
                event: "exchange",
                message: format!("ranks {missing:?} did not arrive within 120 s"),
            });
        }
        Ok(s.result.clone())
    }
}

/// A device buffer's values on the host (f32 values are exact in f64).
fn to_host<B: burn::tensor::backend::Backend>(buffer: Tensor<B, 1>) -> Vec<f64> {
    buffer
        .into_data()
        .to_vec::<f32>()
        .expect("f32 buffers")
        .into_iter()
        .map(f64::from)
        .collect()
}

/// Host values as a device buffer on `device`.
fn from_host<B: burn::tensor::backend::Backend>(
    values: Vec<f32>,
    device: &B::Device,
) -> Tensor<B, 1> {
    let n = values.len();
    Tensor::from_data(TensorData::new(values, [n]), device)
}

/// One rank's end of a [`Hub`].
pub struct ThreadCollective {
    /// This end's rank.
    pub rank: usize,
    /// Where the ranks meet.
    pub hub: Arc<Hub>,
}

impl<S: Setup> Collective<S> for ThreadCollective {
    fn world(&self) -> World {
        World {
            rank: self.rank,
            size: self.hub.size,
        }
    }

    fn all_reduce_sum(
        &mut self,
        buffer: Tensor<InnerBackendOf<S>, 1>,
    ) -> Result<Tensor<InnerBackendOf<S>, 1>> {
        let device = buffer.device();
        let all = self.hub.exchange(self.rank, to_host(buffer))?;
        // Sum in f32, in rank order: the same bits on every rank.
        let mut sum = vec![0f32; all[0].len()];
        for part in &all {
            for (s, v) in sum.iter_mut().zip(part) {
                *s += *v as f32;
            }
        }
        Ok(from_host(sum, &device))
    }

    fn all_reduce_sum_host(&mut self, values: &mut [f64]) -> Result<()> {
        let all = self.hub.exchange(self.rank, values.to_vec())?;
        for (i, v) in values.iter_mut().enumerate() {
            *v = all.iter().map(|p| p[i]).sum();
        }
        Ok(())
    }

    fn broadcast(
        &mut self,
        buffer: Tensor<InnerBackendOf<S>, 1>,
    ) -> Result<Tensor<InnerBackendOf<S>, 1>> {
        let device = buffer.device();
        let all = self.hub.exchange(self.rank, to_host(buffer))?;
        Ok(from_host(
            all[0].iter().map(|v| *v as f32).collect(),
            &device,
        ))
    }
}

/// Runs `f(rank, collective)` on `n` threads and returns every result, in rank order.
pub fn ranks<T: Send + 'static>(
    n: usize,
    f: impl Fn(usize, ThreadCollective) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let hub = Hub::new(n);
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|rank| {
            let (hub, f) = (hub.clone(), f.clone());
            std::thread::spawn(move || f(rank, ThreadCollective { rank, hub }))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

/// Runs `f(rank, collective)` on two threads and returns both results, rank 0 first.
pub fn two_ranks<T: Send + 'static>(
    f: impl Fn(usize, ThreadCollective) -> T + Send + Sync + 'static,
) -> (T, T) {
    let mut out = ranks(2, f).into_iter();
    let a = out.next().expect("rank 0");
    let b = out.next().expect("rank 1");
    (a, b)
}
