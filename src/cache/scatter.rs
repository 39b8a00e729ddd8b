//! Scattered appends: row `r` of a slab lands in row `map[r]` of its slot (a paged pool's page rows),
//! by one slab-write dispatch per slot however many runs the rows make. The map, and host rows, are
//! uploaded in one write per call.

use super::gpu_append::Kept;
use super::source::{self, Source, SourceJob};
use super::{GpuSlab, HostRows, HostSlab, KvCache, Rows, UPLOAD, trim};
use crate::codec::DType;
use crate::error::Result;
use crate::kernels::{WriteParams, check_staging, grid, write_outputs};

/// One slot's checked and bound scattered move.
pub(crate) struct Scatter {
    src_dtype: DType,
    dst_dtype: DType,
    params: WriteParams,
    vec4: bool,
    group: wgpu::BindGroup,
    kept: Option<Kept>,
}

impl KvCache {
    /// Checks GPU slabs of `map.len()` rows (shapes already checked against the layer's slots) for a
    /// scattered move and binds them; records nothing. `None` when the rows are better moved run by
    /// run: every source is a plain copy and `copies` is false, or a source can only be copied (it
    /// is not bound as storage, or too large to bind), or the map would not fit one binding.
    pub(crate) fn prepare_gpu_scatter(
        &mut self,
        layer: usize,
        slabs: &[GpuSlab<'_>],
        map: &[u32],
        copies: bool,
    ) -> Result<Option<Vec<Scatter>>> {
        let n_new = map.len();
        // The map is bound whole: one that would not fit one binding moves the rows run by run.
        if 4 * n_new as u64 > self.max_binding {
            return Ok(None);
        }
        let mut jobs = Vec::with_capacity(slabs.len());
        for (slot, slab) in slabs.iter().enumerate() {
            let src = self.source_of(layer, slot, slab, slab.offset, slab.shape);
            let dst = self.destination(layer, slot);
            let job = source::plan_source(layer, slot, &src, &dst, n_new)?;
            jobs.push((src, dst, job));
        }
        if !copies && !jobs.iter().any(|j| matches!(j.2, SourceJob::Kernel { .. })) {
            return Ok(None);
        }
        for (slot, (src, dst, job)) in jobs.iter_mut().enumerate() {
            if let SourceJob::Copy { .. } = job {
                // A copy cannot scatter; the kernel moves the same bits when it may bind the source.
                let bound = Source {
                    usage: src.usage - wgpu::BufferUsages::COPY_SRC,
                    ..*src
                };
                match source::plan_source(layer, slot, &bound, dst, n_new) {
                    Ok(kernel @ SourceJob::Kernel { .. }) => *job = kernel,
                    _ => return Ok(None),
                }
            }
        }
        // Every source is checked (bound with the map's place) before the map is written; a
        // refusal leaves the upload ring as it was.
        let map_bytes: &[u8] = bytemuck::cast_slice(map);
        let (upload, scatters) = self.rewinding(|c| {
            let upload = c
                .uploads
                .reserve("a scattered append's row map", map_bytes.len() as u64)?;
            let mut scatters = Vec::with_capacity(jobs.len());
            for (slot, (.., job)) in jobs.into_iter().enumerate() {
                let (group, kept) =
                    c.prepare_source(layer, slot, &slabs[slot], &job, Some(&upload.buffer))?;
                if let (SourceJob::Kernel { params, vec4, .. }, Some(group)) = (job, group) {
                    scatters.push(Scatter {
                        src_dtype: slabs[slot].dtype,
                        dst_dtype: c.slots[layer][slot].dtype,
                        params: WriteParams {
                            map_word: (upload.offset / 4) as u32,
                            ..params
                        },
                        vec4,
                        group,
                        kept,
                    });
                }
            }
            c.ring.reserve(scatters.len() as u64)?;
            Ok((upload, scatters))
        })?;
        upload.write(&self.queue, map_bytes);
        Ok(Some(scatters))
    }

    /// Uploads checked host slabs of `map.len()` rows and their map in one write, and records one
    /// scattered dispatch per slot. `false`, with no dispatch recorded, when the upload would not fit
    /// one storage binding, this process has no room for its host bytes, or a slot's dispatch could
    /// not bind it (found before anything is written, and the upload's place given back): the
    /// caller then moves the rows run by run. An upload the device cannot hold
    /// ([`UploadRing::reserve`](crate::kernels::UploadRing::reserve),
    /// [`check_staging`](crate::kernels::check_staging)) is refused with
    /// [`crate::Error::OutOfMemory`], and records nothing.
    pub(crate) fn record_host_scatter(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        layer: usize,
        slabs: &[HostSlab<'_>],
        map: &[u32],
    ) -> Result<bool> {
        // The map, then each slot's rows as stored, every part on a 16-byte boundary: sized first,
        // so that an upload too large for one binding, or one the device cannot hold, is not built
        // (a long prefill's upload takes as many bytes again on the host).
        let mut starts = Vec::with_capacity(slabs.len());
        let size = self.slots[layer][..slabs.len()]
            .iter()
            .fold(4 * map.len() as u64, |at, sb| {
                let start = at.next_multiple_of(16);
                starts.push(start);
                start + map.len() as u64 * sb.placement.row_bytes
            })
            .next_multiple_of(16);
        if size > self.max_binding {
            return Ok(false);
        }
        // The host memory of the rows' conversion first (the checks below count without it), then
        // the host bytes of the upload: where this process has no room for those (a browser's wasm
        // memory), the rows move run by run, with no copy of them all.
        let rows = [HostRows {
            layer,
            rows: Rows::Slabs(slabs),
            runs: std::borrow::Cow::Borrowed(&[]),
        }];
        self.reserve_scratch(&rows)?;
        self.upload_bytes.clear();
        let room = usize::try_from(size)
            .ok()
            .is_some_and(|size| self.upload_bytes.try_reserve_exact(size).is_ok());
        if !room {
            return Ok(false);
        }
        let mark = self.upload_mark();
        let upload = self
            .rewinding(|c| {
                let upload = c.uploads.reserve(UPLOAD, size)?;
                check_staging(&c.device, UPLOAD, size)?;
                c.ring.reserve(slabs.len() as u64)?;
                Ok(upload)
            })
            .inspect_err(|_| {
                trim(&mut self.upload_bytes);
                trim(&mut self.scratch);
            })?;
        // Every slot's dispatch is bound before the upload is written, so that one that could not
        // bind it gives its place in the upload ring back. (The upload buffer is this device's own,
        // and known as such in the browser, so binding it does not fail.)
        let bind_size = upload.buffer.size();
        let mut scatters = Vec::with_capacity(slabs.len());
        for (slot, &start) in starts.iter().enumerate() {
            let row_words = self.slots[layer][slot].placement.row_bytes / 4;
            // The rows are converted (or quantized) on the host, padding included: whatever the
            // storage type, the kernel moves their words as f32 elements, bit for bit.
            let mut params = WriteParams {
                src_offset: ((upload.offset + start) / 4) as u32,
                seq_stride: row_words as u32,
                n_rows: map.len() as u32,
                row_elems: row_words as u32,
                row_words: row_words as u32,
                rank: 1,
                map_word: (upload.offset / 4) as u32,
                ..Default::default()
            };
            params.shape[0] = row_words as u32;
            params.stride[0] = 1;
            // Rows start on 16-byte boundaries of the upload.
            let vec4 = row_words.is_multiple_of(4);
            let job = SourceJob::Kernel {
                params,
                bind_offset: 0,
                bind_size,
                vec4,
            };
            let slab = GpuSlab::contiguous(&upload.buffer, DType::F32, &[]);
            let Ok((Some(group), kept)) =
                self.prepare_source(layer, slot, &slab, &job, Some(&upload.buffer))
            else {
                self.upload_rewind(mark);
                trim(&mut self.upload_bytes);
                trim(&mut self.scratch);
                return Ok(false);
            };
            scatters.push(Scatter {
                src_dtype: DType::F32,
                dst_dtype: DType::F32,
                params,
                vec4,
                group,
                kept,
            });
        }
        let mut bytes = std::mem::take(&mut self.upload_bytes);
        bytes.extend_from_slice(bytemuck::cast_slice(map));
        for (slot, (slab, &start)) in slabs.iter().zip(&starts).enumerate() {
            bytes.resize(bytes.len().next_multiple_of(16), 0);
            debug_assert_eq!(bytes.len() as u64, start);
            let sb = &self.slots[layer][slot];
            bytes.extend_from_slice(sb.stored(slab.data, &mut self.scratch));
        }
        bytes.resize(bytes.len().next_multiple_of(16), 0);
        debug_assert_eq!(bytes.len() as u64, size);
        upload.write(&self.queue, &bytes);
        self.upload_bytes = bytes;
        trim(&mut self.upload_bytes);
        trim(&mut self.scratch);
        self.record_scatters(encoder, scatters);
        Ok(true)
    }

    /// Records scattered moves [`KvCache::prepare_gpu_scatter`] made.
    pub(crate) fn record_scatters(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        scatters: Vec<Scatter>,
    ) {
        for scatter in scatters {
            self.record_scatter(encoder, scatter);
        }
    }

    fn record_scatter(&mut self, encoder: &mut wgpu::CommandEncoder, s: Scatter) {
        if let Some(kept) = s.kept {
            self.keep_source(kept);
        }
        let outputs = write_outputs(&s.params, s.dst_dtype, s.vec4);
        let (groups, thread_stride) = grid(outputs, self.max_workgroups);
        let params = WriteParams {
            thread_stride,
            ..s.params
        };
        let pipeline = self.kernels.write(s.src_dtype, s.dst_dtype, s.vec4, true);
        let params = self.ring.push(&self.queue, &params);
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("kvgpu scatter"),
            timestamp_writes: None,
        });
        pass.set_pipeline(&pipeline);
        pass.set_bind_group(0, &s.group, &[]);
        pass.set_bind_group(1, &params.group, &[params.offset]);
        pass.dispatch_workgroups(groups, 1, 1);
    }
}
