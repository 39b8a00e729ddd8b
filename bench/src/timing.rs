//! Timing: GPU timestamps around recorded work where the adapter has them, wall clock around submit +
//! wait otherwise; medians of interleaved repetitions after a warm-up.

use std::time::Instant;

use anyhow::{Context, Result};

/// How a figure was timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clock {
    /// Timestamp queries written by empty compute passes just before and after the work.
    Timestamps,
    /// Host wall clock around submit + wait (the adapter has no timestamp queries).
    Wall,
    /// Host wall clock around the host API calls + submit + wait: the figure includes host work.
    HostWall,
    /// Host wall clock of CPU work alone.
    Cpu,
    /// Not timed: a count or an error, not a duration.
    Untimed,
}

impl Clock {
    pub fn name(self) -> &'static str {
        match self {
            Clock::Timestamps => "gpu timestamps",
            Clock::Wall => "wall clock (submit + wait)",
            Clock::HostWall => "wall clock (host calls + submit + wait)",
            Clock::Cpu => "wall clock (CPU work only)",
            Clock::Untimed => "not timed",
        }
    }
}

struct Timestamps {
    set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    read: wgpu::Buffer,
    period_ns: f64,
}

/// Times recorded GPU work on one device.
pub struct Timer {
    device: wgpu::Device,
    queue: wgpu::Queue,
    ts: Option<Timestamps>,
}

impl Timer {
    pub fn new(device: &wgpu::Device, queue: &wgpu::Queue) -> Self {
        let ts = device
            .features()
            .contains(wgpu::Features::TIMESTAMP_QUERY)
            .then(|| Timestamps {
                set: device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("bench timestamps"),
                    ty: wgpu::QueryType::Timestamp,
                    count: 2,
                }),
                resolve: device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("bench timestamp resolve"),
                    size: 16,
                    usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                }),
                read: device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("bench timestamp read"),
                    size: 16,
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                }),
                period_ns: queue.get_timestamp_period() as f64,
            });
        Self {
            device: device.clone(),
            queue: queue.clone(),
            ts,
        }
    }

    /// The clock [`Timer::gpu`] uses.
    pub fn clock(&self) -> Clock {
        if self.ts.is_some() {
            Clock::Timestamps
        } else {
            Clock::Wall
        }
    }

    /// Seconds the GPU spends on the work `record` puts in an encoder. Pending `write_buffer`s land
    /// before the first timestamp, so they are not counted with timestamps.
    pub fn gpu(&self, record: impl FnOnce(&mut wgpu::CommandEncoder)) -> Result<f64> {
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                label: Some("bench"),
            });
        let Some(ts) = &self.ts else {
            record(&mut enc);
            let t = Instant::now();
            self.queue.submit([enc.finish()]);
            self.wait()?;
            return Ok(t.elapsed().as_secs_f64());
        };
        let mark = |enc: &mut wgpu::CommandEncoder, begin: Option<u32>, end: Option<u32>| {
            drop(enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("bench timestamp"),
                timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                    query_set: &ts.set,
                    beginning_of_pass_write_index: begin,
                    end_of_pass_write_index: end,
                }),
            }));
        };
        mark(&mut enc, None, Some(0));
        record(&mut enc);
        mark(&mut enc, Some(1), None);
        enc.resolve_query_set(&ts.set, 0..2, &ts.resolve, 0);
        enc.copy_buffer_to_buffer(&ts.resolve, 0, &ts.read, 0, 16);
        self.queue.submit([enc.finish()]);
        ts.read.map_async(wgpu::MapMode::Read, .., |_| {});
        self.wait()?;
        let ticks: Vec<u64> = {
            let view = ts
                .read
                .get_mapped_range(..)
                .map_err(|e| anyhow::anyhow!("mapping timestamps: {e}"))?;
            bytemuck::pod_collect_to_vec(&view)
        };
        ts.read.unmap();
        Ok(ticks[1].saturating_sub(ticks[0]) as f64 * ts.period_ns * 1e-9)
    }

    /// Seconds per call of `calls` calls that `record` puts back to back in one encoder (one
    /// submission, timed as [`Timer::gpu`] times it).
    pub fn gpu_calls(
        &self,
        calls: usize,
        mut record: impl FnMut(&mut wgpu::CommandEncoder),
    ) -> Result<f64> {
        let t = self.gpu(|enc| (0..calls).for_each(|_| record(enc)))?;
        Ok(t / calls as f64)
    }

    /// Waits until the queue is idle.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .context("waiting for the device")?;
        Ok(())
    }

    /// Seconds of host calls plus an empty submit and the wait for the GPU.
    pub fn host(&self, work: impl FnOnce() -> Result<()>) -> Result<f64> {
        let t = Instant::now();
        work()?;
        self.queue.submit([]);
        self.wait()?;
        Ok(t.elapsed().as_secs_f64())
    }
}

/// Median of the samples (seconds).
pub fn median(samples: &mut [f64]) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    if n % 2 == 1 {
        samples[n / 2]
    } else {
        0.5 * (samples[n / 2 - 1] + samples[n / 2])
    }
}

/// Runs every closure `warm` times, then `reps` times interleaved (a, b, c, a, b, c, ...), and returns
/// each one's median: drift of the machine hits all of them alike.
pub fn interleaved<const N: usize>(
    warm: usize,
    reps: usize,
    mut runs: [&mut dyn FnMut() -> Result<f64>; N],
) -> Result<[f64; N]> {
    let medians = interleaved_all(warm, reps, &mut runs)?;
    Ok(std::array::from_fn(|i| medians[i]))
}

/// [`interleaved`] over any number of closures.
pub fn interleaved_all(
    warm: usize,
    reps: usize,
    runs: &mut [&mut dyn FnMut() -> Result<f64>],
) -> Result<Vec<f64>> {
    for _ in 0..warm {
        for run in runs.iter_mut() {
            run()?;
        }
    }
    let mut samples: Vec<Vec<f64>> = runs.iter().map(|_| Vec::with_capacity(reps)).collect();
    for _ in 0..reps {
        for (run, s) in runs.iter_mut().zip(samples.iter_mut()) {
            s.push(run()?);
        }
    }
    Ok(samples.into_iter().map(|mut s| median(&mut s)).collect())
}
