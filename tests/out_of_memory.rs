//! A cache the device cannot hold is refused with `Error::OutOfMemory`, before anything uses its
//! buffers, and the device, its kernel registry and the caches made after it work as before; so are
//! readbacks, imports (whole or streamed), host appends, uploads, page tables, copy-on-write staging,
//! parameter buffers (resets, scrubs, converting GPU appends, attention) and attention calls whose
//! buffers it cannot allocate. A batch naming more queries than the call
//! has is refused before its query table is built, and an import the device cannot stage before
//! the pool's page table grows.
//!
//! A software adapter backs buffers with this process's memory, so the test caps the process's
//! address space (`RLIMIT_AS`, raised back afterwards) a little above what it uses, and asks for more.
//! The tests of this binary run one at a time, so the cap touches no other test.
#![cfg(target_os = "linux")]

mod common;

use common::shared::{f32_buffer, kernels_for, read_f32};
use common::*;
use kvgpu::*;

/// This process's address space now (`VmSize` of `/proc/self/status`), in bytes.
fn address_space() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse().ok())
        .expect("VmSize in /proc/self/status");
    kib << 10
}

/// The process's address-space limits.
fn limits() -> libc::rlimit {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the struct given.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) }, 0);
    limit
}

/// Puts the soft address-space limit back when dropped (also when the test fails).
struct Cap(libc::rlimit);

impl Cap {
    /// Caps this process's address space at what it uses now plus `room` bytes.
    fn room(room: u64) -> Self {
        // A panic under the cap prints its backtrace with memory the cap may not leave, and then
        // hangs instead of failing (the allocation-error hook waits for the backtrace lock the
        // panic holds): the panic hook lifts the cap first.
        static HOOK: std::sync::Once = std::sync::Once::new();
        HOOK.call_once(|| {
            let default = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                let mut limit = limits();
                limit.rlim_cur = limit.rlim_max;
                // SAFETY: setrlimit reads only the struct given.
                unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) };
                default(info);
            }));
        });
        let old = limits();
        let capped = libc::rlimit {
            rlim_cur: (address_space() + room).min(old.rlim_max),
            rlim_max: old.rlim_max,
        };
        // SAFETY: setrlimit reads only the struct given.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &capped) }, 0);
        Cap(old)
    }
}

impl Drop for Cap {
    fn drop(&mut self) {
        // SAFETY: as above; the soft limit goes back to at most the unchanged hard limit.
        unsafe { libc::setrlimit(libc::RLIMIT_AS, &self.0) };
    }
}

/// Counts the losses of the devices it watches.
#[derive(Default)]
struct Losses(std::sync::Arc<std::sync::atomic::AtomicUsize>);

impl Losses {
    fn watch(&self, device: &wgpu::Device) {
        let count = self.0.clone();
        device.set_device_lost_callback(move |_, _| {
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        });
    }

    fn assert_none(&self) {
        let lost = self.0.load(std::sync::atomic::Ordering::SeqCst);
        assert_eq!(lost, 0, "a device was lost");
    }
}

/// Whether the suite's adapter allocates buffers from this process's memory and reports a failure
/// (lavapipe); says why not where it does not.
fn reports_host_memory(g: &Gpu) -> bool {
    let info = g.adapter.get_info();
    if info.device_type != wgpu::DeviceType::Cpu {
        common::shared::skipped(&format!(
            "this test caps the process's memory, and {} keeps buffers in its own",
            g.describe()
        ));
        return false;
    }
    if info.backend == wgpu::Backend::Gl {
        common::shared::skipped(
            "wgpu's OpenGL backend does not report a buffer the driver could not allocate \
             (wgpu-hal 30 does not read GL_OUT_OF_MEMORY: such a buffer reads as zeros)",
        );
        return false;
    }
    true
}

#[test]
fn caches_larger_than_the_device_memory_are_refused_and_change_nothing() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    let kernels = Kernels::new(&g.device, &g.queue).unwrap();
    let live = || g.device.get_internal_counters().hal.buffers.read();
    // Slots as large as one binding allows (128 MiB on the software adapters), 64 of them.
    let layer = LayerSpec::kv(8, 128, 128);
    let rows = (g.limits().max_slot_bytes() / (8 * 128 * 4)) as usize;
    let spec = CacheSpec::new(vec![layer.clone(); 32], DType::F32, rows).unwrap();
    let before = live();
    let (made, paged) = {
        let _cap = Cap::room(1 << 30);
        (
            KvCache::with_kernels(kernels.clone(), spec.clone()),
            PagedCache::with_kernels(kernels.clone(), spec.clone(), 64, rows / 64),
        )
    };
    for (e, what) in [(made.err(), "cache"), (paged.err(), "pool")] {
        match &e {
            Some(Error::OutOfMemory { what: w, bytes, .. }) => {
                assert_eq!(w, "the cache's slot buffers", "{what}");
                assert!(*bytes >= spec.total_bytes(), "{what}: {bytes} bytes");
                eprintln!("{what} refused: {}", e.unwrap());
            }
            other => panic!("{what} of {} bytes: {other:?}", spec.total_bytes()),
        }
    }
    assert_eq!(live(), before, "the refused caches' buffers are released");
    // The registry and the device work as before.
    let small = CacheSpec::new(vec![layer; 2], DType::F32, 4).unwrap();
    let mut c = KvCache::with_kernels(kernels, small).unwrap();
    let d = values(1, 8 * 128);
    for l in 0..2 {
        c.append(
            l,
            &[
                HostSlab::f32(&d, &[1, 8, 128]),
                HostSlab::f32(&d, &[1, 8, 128]),
            ],
        )
        .unwrap();
    }
    c.advance(1).unwrap();
    c.reset().unwrap();
    c.append(0, &[HostSlab::f32(&d, &[1, 8, 128]); 2]).unwrap();
    assert_eq!(c.read_f32(0, 1).unwrap(), d);
}

/// One f32 layer of 8 KV heads of 128 whose slots are as large as one binding allows (128 MiB on
/// the software adapters): its rows and spec.
fn binding_sized(g: &Gpu) -> (usize, CacheSpec) {
    let rows = (g.limits().max_slot_bytes() / (8 * 128 * 4)) as usize;
    let spec = CacheSpec::new(vec![LayerSpec::kv(8, 128, 128)], DType::F32, rows).unwrap();
    (rows, spec)
}

/// A cache of [`binding_sized`]'s layer, every row written (K and V both `values(2, ..)`).
fn binding_filled(g: &Gpu) -> (usize, CacheSpec, KvCache) {
    let (rows, spec) = binding_sized(g);
    let mut c = cache(spec.clone());
    let d = values(2, rows * 8 * 128);
    c.append(0, &[HostSlab::f32(&d, &[rows, 8, 128]); 2])
        .unwrap();
    c.advance(rows).unwrap();
    (rows, spec, c)
}

#[test]
fn readbacks_and_imports_the_device_cannot_stage_are_refused_and_change_nothing() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    // One layer whose slots are as large as a binding allows, every row written.
    let (rows, spec, c) = binding_filled(g);
    let d = values(2, rows * 8 * 128);
    let bytes = c.snapshot().unwrap();
    let mut to = cache(spec.clone());
    let mut pool = PagedCache::new(&g.device, &g.queue, spec.clone(), 64, rows / 64).unwrap();
    // wgpu 30 loses a device that cannot stage a host write (`Queue::write_buffer`); imports of
    // more than 4 MiB check first that the device can stage them, so nothing is lost. They run on
    // devices of their own, of the same adapter, whose loss is counted.
    let lost = Losses::default();
    let device = || {
        let (device, queue) =
            pollster::block_on(g.adapter.request_device(&Default::default())).unwrap();
        lost.watch(&device);
        (device, queue)
    };
    let (d1, q1) = device();
    let mut written = KvCache::new(&d1, &q1, spec.clone()).unwrap();
    let (d2, q2) = device();
    let mut written_pool = PagedCache::new(&d2, &q2, spec, 64, rows / 64).unwrap();
    {
        let _cap = Cap::room(32 << 20);
        // A readback's staging buffer (the slot's 128 MiB on the software adapters).
        let e = c.read_f32(0, 1).unwrap_err();
        assert!(
            matches!(&e, Error::Readback { layer: 0, slot: 1, reason } if reason.contains("could not allocate")),
            "{e}"
        );
        let e = c.snapshot().unwrap_err();
        assert!(
            matches!(&e, Error::Readback { layer: 0, slot: 0, reason } if reason.contains("could not allocate")),
            "{e}"
        );
        // A streamed import's staging buffers (as large as the snapshot's rows).
        let e = to.import_from(&bytes[..]).unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory { what, .. } if what == "a snapshot's staging buffers"),
            "{e}"
        );
        eprintln!("refused: {e}");
        let e = pool.import_sequence_from(&bytes[..]).unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory { what, .. } if what == "a snapshot's staging buffers"),
            "{e}"
        );
        // An import of the bytes, which the device could not stage.
        let e = written.import(&bytes).unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory { what, .. } if what == "the snapshot's rows"),
            "{e}"
        );
        let e = written_pool.import_sequence(&bytes).unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory { what, .. } if what == "the snapshot's rows"),
            "{e}"
        );
    }
    assert!(to.is_empty() && written.is_empty());
    assert_eq!(pool.ledger().sequences().count(), 0);
    assert_eq!(written_pool.ledger().sequences().count(), 0);
    assert_eq!(c.len(), rows);
    // All of them work once there is room, the imports of bytes on the same devices.
    assert_eq!(c.read_f32(0, 1).unwrap(), d);
    assert_eq!(to.import_from(&bytes[..]).unwrap(), rows);
    assert_eq!(to.read_f32(0, 0).unwrap(), d);
    let seq = pool.import_sequence_from(&bytes[..]).unwrap();
    assert_eq!(pool.len(seq).unwrap(), rows);
    assert_eq!(written.import(&bytes).unwrap(), rows);
    assert_eq!(written.read_f32(0, 1).unwrap(), d);
    let seq = written_pool.import_sequence(&bytes).unwrap();
    assert_eq!(written_pool.len(seq).unwrap(), rows);
    assert_eq!(
        pollster::block_on(written_pool.read_f32_async(seq, 0, 0)).unwrap(),
        d
    );
    lost.assert_none();
}

/// Host rows converted on the way in (f32 rows into f16 slots, the rows of a step too large for
/// one upload) take host memory for their stored form besides the writes' staging. That memory is
/// reserved before the staging is checked: with room for the staging alone the calls are refused
/// with `OutOfMemory`, change nothing and keep none of that memory, where wgpu 30 failed to stage
/// the second slot's write and panicked (the device lost). With room, the same calls append.
#[test]
fn converted_host_rows_are_counted_before_their_staging() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    // f16 slots as large as a binding allows, filled by one call of f32 rows.
    let rows = (g.limits().max_slot_bytes() / (8 * 128 * 2)) as usize;
    let spec = CacheSpec::new(vec![LayerSpec::kv(8, 128, 128)], DType::F16, rows).unwrap();
    let stored = 2 * (rows * 8 * 128 * 2) as u64;
    assert!(stored >= 128 << 20, "slots of {stored} bytes in all");
    let d = values(3, rows * 8 * 128);
    let shape = [rows, 8, 128];
    let slabs = [HostSlab::f32(&d, &shape); 2];
    let lost = Losses::default();
    lost.watch(&g.device);
    let mut c = cache(spec.clone());
    let mut pool = PagedCache::new(&g.device, &g.queue, spec.clone(), 64, rows / 64).unwrap();
    let seq = pool.add_sequence().unwrap();
    let mut recorded = cache(spec);
    let mut encoder = g.device.create_command_encoder(&Default::default());
    let refused = |e: Error| assert!(matches!(e, Error::OutOfMemory { .. }), "{e}");
    let before = address_space();
    {
        let _cap = Cap::room(stored + (16 << 20));
        refused(c.append(0, &slabs).unwrap_err());
        refused(pool.append(seq, 0, &slabs).unwrap_err());
        refused(
            recorded
                .record_append_layers(&mut encoder, &[&slabs])
                .unwrap_err(),
        );
    }
    // Each refusal let go of its conversion's memory (a slot's worth of f16 rows, 64 MiB or more).
    let kept = address_space().saturating_sub(before);
    assert!(kept < 32 << 20, "the refused appends kept {kept} bytes");
    g.queue.submit([encoder.finish()]);
    lost.assert_none();
    assert_eq!(c.visible(0).unwrap(), 0);
    assert_eq!(pool.visible(seq, 0).unwrap(), 0);
    assert_eq!(recorded.visible(0).unwrap(), 0);
    c.append(0, &slabs).unwrap();
    c.advance(rows).unwrap();
    let want: Vec<f32> = d.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect();
    assert!(
        c.read_f32(0, 1).unwrap() == want,
        "the rows appended with room"
    );
    lost.assert_none();
}

/// A scattered host append (one upload, one dispatch per slot) of f32 rows into f16 slots,
/// refused because the device cannot make its upload, keeps none of the host memory it reserved
/// first: with room for the rows' conversion (a slot's worth, 48 MiB) and the upload's host bytes
/// (96 MiB) but not for the upload buffer beside them, the append is refused with `OutOfMemory`,
/// changes nothing and lets both go; with room, it lands.
#[test]
fn a_refused_scattered_host_append_keeps_no_conversion_memory() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    let rows = 24_576;
    let slot = (rows * 8 * 128 * 2) as u64;
    let spec = CacheSpec::new(vec![LayerSpec::kv(8, 128, 128)], DType::F16, rows).unwrap();
    assert!(
        2 * slot < g.limits().max_slot_bytes(),
        "the upload fits one binding"
    );
    let (k, v) = (values(16, rows * 8 * 128), values(17, rows * 8 * 128));
    let shape = [rows, 8, 128];
    let slabs = kv(&k, &v, &shape);
    let lost = Losses::default();
    lost.watch(&g.device);
    let mut pool = PagedCache::new(&g.device, &g.queue, spec, 64, rows / 64).unwrap();
    pool.set_scatter(ScatterChoice::Always);
    let seq = pool.add_sequence().unwrap();
    let ledger = pool.ledger().clone();
    let before = address_space();
    let e = {
        let _cap = Cap::room(4 * slot);
        pool.append(seq, 0, &slabs).unwrap_err()
    };
    // Refused at the upload, after the conversion and the upload's host bytes were reserved.
    assert!(
        matches!(&e, Error::OutOfMemory { what, .. } if what == "an upload of host rows"),
        "{e}"
    );
    let kept = address_space().saturating_sub(before);
    assert!(kept < 32 << 20, "the refused append kept {kept} bytes");
    assert_eq!(
        pool.ledger(),
        &ledger,
        "the refused append changed the pool"
    );
    pool.append(seq, 0, &slabs).unwrap();
    let stored =
        |x: &[f32]| -> Vec<f32> { x.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect() };
    let read = |slot| pollster::block_on(pool.read_f32_async(seq, 0, slot)).unwrap();
    assert!(read(0) == stored(&k), "the keys appended with room");
    assert!(read(1) == stored(&v), "the values appended with room");
    lost.assert_none();
}

/// A readback copies the bytes it maps once, into the words it returns: with room for its staging
/// buffer and one copy of the slot, `read_words` and the pool's `read_words` return them (a second,
/// infallible copy into words aborted the process there), and with room for the staging buffer
/// alone they are refused.
#[test]
fn a_readback_copies_its_bytes_once() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    let (rows, spec, c) = binding_filled(g);
    let mut pool = PagedCache::new(&g.device, &g.queue, spec, 64, rows / 64).unwrap();
    let seq = pool.add_sequence().unwrap();
    let d = values(2, rows * 8 * 128);
    pool.append(seq, 0, &[HostSlab::f32(&d, &[rows, 8, 128]); 2])
        .unwrap();
    pool.advance(seq, rows).unwrap();
    drop(d);
    let want = c.read_words(0, 1).unwrap();
    let bytes = 4 * want.len() as u64;
    // A second copy of the slot must not fit the margin below.
    assert!(bytes >= 64 << 20, "a slot of {bytes} bytes");
    // Each read under a cap of its own, counted from what the process holds then.
    let room = 2 * bytes + (32 << 20);
    let words = {
        let _cap = Cap::room(room);
        c.read_words(0, 1)
    };
    assert!(words.unwrap() == want, "the cache's words");
    let pool_words = {
        let _cap = Cap::room(room);
        pool.read_words(seq, 0, 1)
    };
    assert!(pool_words.unwrap() == want, "the pool's words");
    let refused = {
        let _cap = Cap::room(bytes + (32 << 20));
        c.read_words(0, 1).map(|w| w.len())
    };
    let e = refused.unwrap_err();
    assert!(
        matches!(&e, Error::Readback { layer: 0, slot: 1, reason } if reason.contains("no room")),
        "{e}"
    );
}

/// The bytes of the allocations named `label` on the device (Vulkan's allocator report).
fn allocated_as(device: &wgpu::Device, label: &str) -> Option<u64> {
    let report = device.generate_allocator_report()?;
    Some(
        report
            .allocations
            .iter()
            .filter(|a| a.name == label)
            .map(|a| a.size)
            .sum(),
    )
}

#[test]
fn an_import_the_device_cannot_stage_is_refused_before_the_page_table_grows() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    // Rows of 1 KiB in pages of 64: a snapshot of 98,304 rows is 96 MiB of rows, more than the
    // device keeps in any memory block it made before, so it stages them only with room for them.
    // The pool's table holds 8 sequences at first; they are there, so a ninth would grow it.
    let rows = 96 << 10;
    let layer = LayerSpec::new(vec![SlotSpec::new("s", &[256])]);
    let spec = CacheSpec::new(vec![layer], DType::F32, rows).unwrap();
    let mut c = cache(spec.clone());
    let d = values(12, rows * 256);
    c.append(0, &[HostSlab::f32(&d, &[rows, 256])]).unwrap();
    c.advance(rows).unwrap();
    let bytes = c.snapshot().unwrap();
    let mut pool = PagedCache::new(&g.device, &g.queue, spec, 64, 8 + rows / 64).unwrap();
    for _ in 0..8 {
        pool.add_sequence().unwrap();
    }
    let ledger = pool.ledger().clone();
    let Some(table) = allocated_as(&g.device, "kvgpu page table") else {
        common::shared::skipped(&format!("{} gives no allocator report", g.describe()));
        return;
    };
    assert!(table > 0, "no page table in the allocator report");
    {
        let _cap = Cap::room(4 << 20);
        let e = pool.import_sequence(&bytes).unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory { what, .. } if what == "the snapshot's rows"),
            "{e}"
        );
        eprintln!("refused: {e}");
    }
    assert_eq!(
        pool.ledger(),
        &ledger,
        "the refused import changed the pool"
    );
    assert_eq!(
        allocated_as(&g.device, "kvgpu page table"),
        Some(table),
        "the refused import grew the page table"
    );
    // With room, it lands in the grown table.
    let seq = pool.import_sequence(&bytes).unwrap();
    assert_eq!(
        pollster::block_on(pool.read_f32_async(seq, 0, 0)).unwrap(),
        d
    );
    assert!(allocated_as(&g.device, "kvgpu page table").unwrap() > table);
}

/// K and V host slabs of `shape`, from the first rows of `k` and `v` (8 heads of 128).
fn kv<'a>(k: &'a [f32], v: &'a [f32], shape: &'a [usize; 3]) -> [HostSlab<'a>; 2] {
    let n = shape[0] * 1024;
    [HostSlab::f32(&k[..n], shape), HostSlab::f32(&v[..n], shape)]
}

#[test]
fn host_appends_the_device_cannot_stage_are_refused_and_change_nothing() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    // Slots as large as a binding allows (128 MiB on the software adapters), filled by one append,
    // with room for far less: wgpu 30 loses the device where it cannot allocate a `write_buffer`'s
    // staging, so kvgpu checks first that the device can stage such rows.
    let (rows, spec) = binding_sized(g);
    let (k, v) = (values(6, rows * 8 * 128), values(7, rows * 8 * 128));
    let (whole, quarter) = ([rows, 8, 128], [rows / 4, 8, 128]);
    let slabs = |shape| kv(&k, &v, shape);
    let lost = Losses::default();
    lost.watch(&g.device);
    let mut c = cache(spec.clone());
    let mut layers = cache(spec.clone());
    // Recorded, a step this large goes up in pieces copied in the encoder's order.
    let mut recorded = cache(spec.clone());
    let mut pool = PagedCache::new(&g.device, &g.queue, spec.clone(), 64, rows / 64).unwrap();
    let seq = pool.add_sequence().unwrap();
    // A quarter of the slots by one scattered dispatch per slot, from an upload of 64 MiB (the
    // whole slots' would not fit one binding, and move run by run as above).
    let mut scattered = PagedCache::new(&g.device, &g.queue, spec, 64, rows / 64).unwrap();
    scattered.set_scatter(ScatterChoice::Always);
    // Its upload's host bytes are reserved before the pool assembles them (an allocation of 64 MiB
    // past the cap aborted the process): with no room for them the rows move run by run, whose
    // staging is refused as the pool's above.
    let other = scattered.add_sequence().unwrap();
    let staging = |e: Error, what: &str| {
        assert!(
            matches!(&e, Error::OutOfMemory { what: w, bytes, .. } if w == what && *bytes >= 64 << 20),
            "{e}"
        );
        eprintln!("refused: {e}");
    };
    {
        let _cap = Cap::room(8 << 20);
        staging(
            c.append(0, &slabs(&whole)).unwrap_err(),
            "the staging of host rows",
        );
        staging(
            layers.append_layers(&[&slabs(&whole)]).unwrap_err(),
            "the staging of host rows",
        );
        let mut encoder = g.device.create_command_encoder(&Default::default());
        staging(
            recorded
                .record_append_layers(&mut encoder, &[&slabs(&whole)])
                .unwrap_err(),
            "the staging of host rows",
        );
        staging(
            pool.append(seq, 0, &slabs(&whole)).unwrap_err(),
            "the staging of host rows",
        );
        staging(
            scattered.append(other, 0, &slabs(&quarter)).unwrap_err(),
            "the staging of host rows",
        );
    }
    assert_eq!(c.visible(0).unwrap(), 0);
    assert_eq!(layers.visible(0).unwrap(), 0);
    assert_eq!(recorded.visible(0).unwrap(), 0);
    assert_eq!(pool.visible(seq, 0).unwrap(), 0);
    assert_eq!(scattered.visible(other, 0).unwrap(), 0);
    assert_eq!(
        pool.free_pages(),
        rows / 64,
        "the refused append took pages"
    );
    // With room, the same calls append every row.
    c.append(0, &slabs(&whole)).unwrap();
    layers.append_layers(&[&slabs(&whole)]).unwrap();
    let mut encoder = g.device.create_command_encoder(&Default::default());
    recorded
        .record_append_layers(&mut encoder, &[&slabs(&whole)])
        .unwrap();
    g.queue.submit([encoder.finish()]);
    pool.append(seq, 0, &slabs(&whole)).unwrap();
    scattered.append(other, 0, &slabs(&quarter)).unwrap();
    assert_eq!(c.read_f32(0, 1).unwrap(), v);
    assert_eq!(layers.read_f32(0, 0).unwrap(), k);
    assert_eq!(recorded.read_f32(0, 1).unwrap(), v);
    let read = |p: &PagedCache, s, slot| pollster::block_on(p.read_f32_async(s, 0, slot)).unwrap();
    assert_eq!(read(&pool, seq, 1), v);
    assert_eq!(read(&scattered, other, 0), k[..rows / 4 * 1024]);
    lost.assert_none();
}

#[test]
fn attention_whose_scratch_the_device_cannot_hold_is_refused_and_changes_nothing() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    // A chunk of 1,024 queries of 64 heads with values of 512 (a long prefill step, a sliding
    // window of 64 rows): the partial results take a whole binding (128 MiB on the software
    // adapters), more than the room the cap leaves, and more than the device's 128 MiB blocks of
    // memory can share with the cache.
    let (n_q, n_heads, d_k, d_v, rows) = (1024, 64, 128, 512, 1024);
    let spec = CacheSpec::new(vec![LayerSpec::kv(8, d_k, d_v)], DType::F16, rows).unwrap();
    let mut c = cache(spec);
    let (k, v) = (values(3, rows * 8 * d_k), values(4, rows * 8 * d_v));
    c.append(
        0,
        &[
            HostSlab::f32(&k, &[rows, 8, d_k]),
            HostSlab::f32(&v, &[rows, 8, d_v]),
        ],
    )
    .unwrap();
    c.advance(rows).unwrap();
    let q = pollster::block_on(f32_buffer(&g.device, &values(5, n_q * n_heads * d_k)));
    let out =
        |fill: f32| pollster::block_on(f32_buffer(&g.device, &vec![fill; n_q * n_heads * d_v]));
    let (want, got) = (out(0.0), out(-1.0));
    let kernels = kernels_for(g);
    let options = AttentionOptions {
        window: Some(64),
        ..Default::default()
    };
    let call = |att: &mut Attention, to: &wgpu::Buffer| {
        att.gqa(&c, 0, Queries::new(&q, n_q, n_heads, d_k), to, &options)
    };
    // The call is refused before it compiles anything (the scratch grows before any pipeline is
    // made).
    let mut att = Attention::with_kernels(kernels.clone());
    {
        let _cap = Cap::room(8 << 20);
        let e = call(&mut att, &got).unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory { what, bytes, .. }
                if what == "attention's scratch buffers" && *bytes > 128 << 20),
            "{e}"
        );
        eprintln!("refused: {e}");
    }
    let untouched = pollster::block_on(read_f32(g, &got));
    assert!(
        untouched.iter().all(|&x| x == -1.0),
        "the refused call wrote"
    );
    // With room, the same `Attention` computes what another one does.
    call(&mut att, &got).unwrap();
    call(&mut Attention::with_kernels(kernels), &want).unwrap();
    assert_eq!(
        pollster::block_on(read_f32(g, &got)),
        pollster::block_on(read_f32(g, &want))
    );
}

/// Buffers of `size` bytes, of the kind the upload rings are made of, made until the device cannot
/// make another (the process's memory capped): the device's memory blocks are then full, and any
/// buffer of `size` or more needs memory the device cannot get.
fn fill_device(g: &Gpu, size: u64) -> Vec<wgpu::Buffer> {
    let mut made = Vec::new();
    loop {
        let scope = g.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buffer = g.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("test filler"),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_DST
                | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        if pollster::block_on(scope.pop()).is_some() {
            return made;
        }
        made.push(buffer);
        assert!(made.len() < 4096, "the device never ran out of memory");
    }
}

#[test]
fn uploads_whose_ring_buffer_the_device_cannot_make_are_refused_and_change_nothing() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    // A decode step's rows and a paged GPU append's table entries go through an upload ring whose
    // buffer (4 MiB) is made at its first use: on a device without room for it, the call is
    // refused before it writes or records anything.
    let spec = CacheSpec::new(vec![LayerSpec::kv(2, 64, 64); 2], DType::F32, 256).unwrap();
    let mut c = cache(spec.clone());
    let mut pool = PagedCache::new(&g.device, &g.queue, spec, 16, 16).unwrap();
    let seq = pool.add_sequence().unwrap();
    let d = values(8, 3 * 2 * 64);
    let src = pollster::block_on(f32_buffer(&g.device, &d));
    let shape = [3, 2, 64];
    let gpu_slab = GpuSlab::contiguous(&src, DType::F32, &shape);
    let host = [HostSlab::f32(&d, &shape), HostSlab::f32(&d, &shape)];
    let lost = Losses::default();
    lost.watch(&g.device);
    let ring = |e: Error, what: &str| {
        assert!(
            matches!(&e, Error::OutOfMemory { what: w, .. } if w == what),
            "{e}"
        );
        eprintln!("refused: {e}");
    };
    {
        let _cap = Cap::room(16 << 20);
        let filler = fill_device(g, 1 << 20);
        ring(
            c.append_layers(&[&host, &host]).unwrap_err(),
            "an upload of host rows",
        );
        let mut encoder = g.device.create_command_encoder(&Default::default());
        ring(
            pool.record_append_gpu(&mut encoder, seq, 0, &[gpu_slab; 2])
                .unwrap_err(),
            "a page table's entries",
        );
        g.queue.submit([encoder.finish()]);
        drop(filler);
    }
    assert_eq!(c.visible(0).unwrap(), 0);
    assert_eq!(pool.visible(seq, 0).unwrap(), 0);
    assert_eq!(pool.free_pages(), 16, "the refused append took pages");
    // With room, the same calls land, and read back exactly.
    c.append_layers(&[&host, &host]).unwrap();
    c.advance(3).unwrap();
    let mut encoder = g.device.create_command_encoder(&Default::default());
    pool.record_append_gpu(&mut encoder, seq, 0, &[gpu_slab; 2])
        .unwrap();
    g.queue.submit([encoder.finish()]);
    assert_eq!(c.read_f32(1, 0).unwrap(), d);
    let read = |slot| pollster::block_on(pool.read_f32_async(seq, 0, slot)).unwrap();
    assert_eq!(read(0), d);
    assert_eq!(read(1), d);
    lost.assert_none();
}

#[test]
fn page_tables_and_copies_the_device_cannot_make_are_refused_and_change_nothing() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    // One f32 element per row in pages of one row, 2^20 pages: a pool of 4 MiB whose table rows
    // hold 2^20 entries each (4 MiB). The table starts with 8 rows (32 MiB); the 9th sequence
    // grows it to 16 (64 MiB).
    let layer = LayerSpec::new(vec![SlotSpec::new("s", &[1])]);
    let spec = CacheSpec::new(vec![layer], DType::F32, 1 << 20).unwrap();
    let mut pool = PagedCache::new(&g.device, &g.queue, spec, 1, 1 << 20).unwrap();
    let seqs: Vec<SeqId> = (0..8).map(|_| pool.add_sequence().unwrap()).collect();
    let one = values(9, 8);
    for (i, &seq) in seqs.iter().enumerate() {
        pool.append(seq, 0, &[HostSlab::f32(&one[i..=i], &[1, 1])])
            .unwrap();
        pool.advance(seq, 1).unwrap();
    }
    // Pages of 4,096 rows of 1 KiB (4 MiB): a sequence forked inside a page copies it on its first
    // append, through a staging buffer of one page that the pool makes at its first copy.
    let wide = LayerSpec::new(vec![SlotSpec::new("s", &[256])]);
    let spec = CacheSpec::new(vec![wide], DType::F32, 1 << 14).unwrap();
    let mut shared = PagedCache::new(&g.device, &g.queue, spec, 4096, 4).unwrap();
    let (d, d2) = (values(10, 256), values(11, 256));
    let parent = shared.add_sequence().unwrap();
    shared
        .append(parent, 0, &[HostSlab::f32(&d, &[1, 256])])
        .unwrap();
    shared.advance(parent, 1).unwrap();
    let child = shared.fork(parent, 1).unwrap();
    let (ledger, shared_ledger) = (pool.ledger().clone(), shared.ledger().clone());
    {
        let _cap = Cap::room(16 << 20);
        let filler = fill_device(g, 1 << 20);
        let e = pool.add_sequence().unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory { what, bytes, .. }
                if what == "the pool's page table" && *bytes == 64 << 20),
            "{e}"
        );
        eprintln!("refused: {e}");
        let e = shared
            .append(child, 0, &[HostSlab::f32(&d2, &[1, 256])])
            .unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory { what, bytes, .. }
                if what == "a page's copy-on-write staging" && *bytes == 4 << 20),
            "{e}"
        );
        eprintln!("refused: {e}");
        drop(filler);
    }
    assert_eq!(
        pool.ledger(),
        &ledger,
        "the refused sequence changed the pool"
    );
    assert_eq!(
        shared.ledger(),
        &shared_ledger,
        "the refused copy changed the pool"
    );
    // With room, the same calls land: the grown table holds every earlier sequence's pages.
    let ninth = pool.add_sequence().unwrap();
    pool.append(ninth, 0, &[HostSlab::f32(&one[..1], &[1, 1])])
        .unwrap();
    let read = |p: &PagedCache, s| pollster::block_on(p.read_f32_async(s, 0, 0)).unwrap();
    for (i, &seq) in seqs.iter().enumerate() {
        assert_eq!(read(&pool, seq), one[i..=i]);
    }
    shared
        .append(child, 0, &[HostSlab::f32(&d2, &[1, 256])])
        .unwrap();
    shared.advance(child, 1).unwrap();
    assert_eq!(read(&shared, child), [&d[..], &d2[..]].concat());
    assert_eq!(read(&shared, parent), d);
}

/// A fork's first append makes the pool's copy-on-write staging buffer; where the append is then
/// refused (a host append whose rows' writes cannot be staged, a GPU append from a source it cannot
/// read), that buffer goes too.
#[test]
fn a_refused_copy_on_write_append_keeps_no_new_staging() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    // Pages of 4,096 rows of 8 KiB: the staging buffer is one page (32 MiB), and 6,000 rows (47
    // MiB, more than the device keeps in any memory block it made before) are checked for memory
    // before they are written.
    let wide = LayerSpec::new(vec![SlotSpec::new("s", &[2048])]);
    let spec = CacheSpec::new(vec![wide], DType::F32, 1 << 14).unwrap();
    let mut pool = PagedCache::new(&g.device, &g.queue, spec, 4096, 4).unwrap();
    let (n, w) = (6000, 2048);
    let (d, rows) = (values(13, w), values(14, n * w));
    let parent = pool.add_sequence().unwrap();
    pool.append(parent, 0, &[HostSlab::f32(&d, &[1, w])])
        .unwrap();
    pool.advance(parent, 1).unwrap();
    let child = pool.fork(parent, 1).unwrap();
    let ledger = pool.ledger().clone();
    let Some(before) = allocated_as(&g.device, "kvgpu page staging") else {
        common::shared::skipped(&format!("{} gives no allocator report", g.describe()));
        return;
    };
    assert_eq!(before, 0, "a staging buffer before the first copy");
    {
        let _cap = Cap::room(40 << 20);
        let e = pool
            .append(child, 0, &[HostSlab::f32(&rows, &[n, w])])
            .unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory { what, .. } if what == "the staging of host rows"),
            "{e}"
        );
        eprintln!("refused: {e}");
    }
    assert_eq!(
        pool.ledger(),
        &ledger,
        "the refused append changed the pool"
    );
    assert_eq!(
        allocated_as(&g.device, "kvgpu page staging"),
        Some(0),
        "the refused append kept its staging buffer"
    );
    // A GPU append makes the staging buffer before it binds its sources: one whose source cannot
    // be read (no STORAGE or COPY_SRC usage) lets it go as well, and records nothing.
    let unreadable = g.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("unreadable"),
        size: (w * 4) as u64,
        usage: wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let slab = GpuSlab {
        buffer: &unreadable,
        dtype: DType::F32,
        offset: 0,
        shape: &[1, w],
        strides: None,
    };
    let mut encoder = g.device.create_command_encoder(&Default::default());
    let e = pool
        .record_append_gpu(&mut encoder, child, 0, &[slab])
        .unwrap_err();
    assert!(
        matches!(
            &e,
            Error::SourceLayout {
                problem: SourceProblem::NeedsStorage { .. },
                ..
            }
        ),
        "{e}"
    );
    g.queue.submit([encoder.finish()]);
    assert_eq!(
        pool.ledger(),
        &ledger,
        "the refused GPU append changed the pool"
    );
    assert_eq!(
        allocated_as(&g.device, "kvgpu page staging"),
        Some(0),
        "the refused GPU append kept its staging buffer"
    );
    // With room, it lands, and the staging buffer stays for later copies.
    pool.append(child, 0, &[HostSlab::f32(&rows, &[n, w])])
        .unwrap();
    pool.advance(child, n).unwrap();
    assert_eq!(
        pollster::block_on(pool.read_f32_async(child, 0, 0)).unwrap(),
        [&d[..], &rows[..]].concat()
    );
    assert_eq!(
        pollster::block_on(pool.read_f32_async(parent, 0, 0)).unwrap(),
        d
    );
    let kept = allocated_as(&g.device, "kvgpu page staging").unwrap();
    assert!(kept >= 32 << 20, "a staging buffer of {kept} bytes");
}

/// A scattered GPU append reserves the upload of its row map before it binds its sources: one whose
/// source belongs to another device is refused, and keeps no new upload or parameter buffer.
#[test]
fn a_refused_scattered_append_keeps_no_new_upload_or_parameter_buffer() {
    let _serial = serial();
    let g = gpu();
    let spec = CacheSpec::new(vec![LayerSpec::kv(2, 8, 8)], DType::F16, 64).unwrap();
    let mut pool = PagedCache::new(&g.device, &g.queue, spec, 4, 8).unwrap();
    pool.set_scatter(ScatterChoice::Always);
    let (a, b) = (pool.add_sequence().unwrap(), pool.add_sequence().unwrap());
    let ledger = pool.ledger().clone();
    let rows = values(15, 2 * 16);
    let (other, _) = pollster::block_on(g.adapter.request_device(&Default::default())).unwrap();
    let foreign = pollster::block_on(f32_buffer(&other, &rows));
    let own = pollster::block_on(f32_buffer(&g.device, &rows));
    let slab = |buffer| GpuSlab {
        buffer,
        dtype: DType::F32,
        offset: 0,
        shape: &[2, 2, 8],
        strides: None,
    };
    let Some(uploads) = allocated_as(&g.device, "kvgpu upload") else {
        common::shared::skipped(&format!("{} gives no allocator report", g.describe()));
        return;
    };
    let params = allocated_as(&g.device, "kvgpu params").unwrap();
    let mut encoder = g.device.create_command_encoder(&Default::default());
    let e = pool
        .record_append_gpu_batch(
            &mut encoder,
            0,
            &[(a, 1), (b, 1)],
            &[slab(&foreign), slab(&foreign)],
        )
        .unwrap_err();
    assert!(matches!(e, Error::ForeignDevice { .. }), "{e}");
    g.queue.submit([encoder.finish()]);
    assert_eq!(
        pool.ledger(),
        &ledger,
        "the refused append changed the pool"
    );
    assert_eq!(
        allocated_as(&g.device, "kvgpu upload"),
        Some(uploads),
        "the refused append kept an upload buffer"
    );
    assert_eq!(
        allocated_as(&g.device, "kvgpu params"),
        Some(params),
        "the refused append kept a parameter buffer"
    );
    // The same append from this device's buffer lands, and makes both (so the counts above see
    // them).
    pool.append_gpu_batch(0, &[(a, 1), (b, 1)], &[slab(&own), slab(&own)])
        .unwrap();
    pool.advance(a, 1).unwrap();
    pool.advance(b, 1).unwrap();
    assert!(allocated_as(&g.device, "kvgpu upload").unwrap() > uploads);
    assert!(allocated_as(&g.device, "kvgpu params").unwrap() > params);
    let stored = reference::round_trip_rows(&rows, DType::F16, 16);
    for (seq, row) in [(a, 0), (b, 1)] {
        for slot in 0..2 {
            let got = pollster::block_on(pool.read_f32_async(seq, 0, slot)).unwrap();
            assert_eq!(got, stored[row * 16..(row + 1) * 16], "{seq:?} slot {slot}");
        }
    }
}

/// A new `Attention`'s first call over a ragged batch, on a device with room for its scratch and
/// its first parameter buffer but not for the buffer of its query table's upload (4 MiB), is refused
/// and keeps neither: it made the parameter buffer first and kept it.
#[test]
fn a_refused_batch_attention_keeps_no_new_parameter_buffer() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    let (n_heads, d) = (4, 64);
    let spec = CacheSpec::new(vec![LayerSpec::kv(2, d, d)], DType::F32, 64).unwrap();
    let mut pool = PagedCache::new(&g.device, &g.queue, spec, 16, 8).unwrap();
    let seqs = [pool.add_sequence().unwrap(), pool.add_sequence().unwrap()];
    let rows = values(16, 3 * 2 * d);
    let shape = [3, 2, d];
    for seq in seqs {
        let slab = HostSlab::f32(&rows, &shape);
        pool.append(seq, 0, &[slab, slab]).unwrap();
        pool.advance(seq, 3).unwrap();
    }
    let q = pollster::block_on(f32_buffer(&g.device, &values(17, 2 * n_heads * d)));
    let out = pollster::block_on(f32_buffer(&g.device, &vec![0.0; 2 * n_heads * d]));
    let batch = [(seqs[0], 1), (seqs[1], 1)];
    let opts = AttentionOptions::default();
    let mut att = Attention::new(&g.device, &g.queue).unwrap();
    let Some(params) = allocated_as(&g.device, "kvgpu params") else {
        common::shared::skipped(&format!("{} gives no allocator report", g.describe()));
        return;
    };
    let lost = Losses::default();
    lost.watch(&g.device);
    {
        let _cap = Cap::room(16 << 20);
        let mut filler = fill_device(g, 1 << 20);
        // Room for the scratch and a parameter buffer (256 KiB), not for the upload's 4 MiB.
        filler.pop();
        let e = att
            .gqa(
                Kv::Batch(&pool, &batch),
                0,
                Queries::new(&q, 2, n_heads, d),
                &out,
                &opts,
            )
            .unwrap_err();
        assert!(
            matches!(&e, Error::OutOfMemory { what, .. } if what == "a batch's query table"),
            "{e}"
        );
        drop(filler);
    }
    assert_eq!(
        allocated_as(&g.device, "kvgpu params"),
        Some(params),
        "the refused call kept a parameter buffer"
    );
    assert_eq!(att.scratch_bytes(), 0, "the refused call kept its scratch");
    // With room the call runs, and makes its parameter buffer (so the count above sees it).
    att.gqa(
        Kv::Batch(&pool, &batch),
        0,
        Queries::new(&q, 2, n_heads, d),
        &out,
        &opts,
    )
    .unwrap();
    assert!(allocated_as(&g.device, "kvgpu params").unwrap() > params);
    lost.assert_none();
}

#[test]
fn streamed_pieces_the_device_cannot_stage_are_refused_and_change_nothing() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    // An app may push a snapshot in pieces of any size: one of 8 MiB is checked like a host write
    // of that size, and refused where the device cannot stage it.
    let layer = LayerSpec::new(vec![SlotSpec::new("s", &[256])]);
    let spec = CacheSpec::new(vec![layer], DType::F32, 1 << 14).unwrap();
    let mut from = cache(spec.clone());
    let n = 8192;
    let d = values(12, n * 256);
    from.append(0, &[HostSlab::f32(&d, &[n, 256])]).unwrap();
    from.advance(n).unwrap();
    let bytes = from.snapshot().unwrap();
    let header = SnapshotHeader::parse(&bytes).unwrap();
    let rows_at = (header.total_bytes() - header.rows_bytes() - 4) as usize;
    let mut to = cache(spec.clone());
    let mut pool = PagedCache::new(&g.device, &g.queue, spec, 64, n / 64).unwrap();
    let lost = Losses::default();
    lost.watch(&g.device);
    // The headers make each import's 8 MiB of staging buffers, before the cap.
    let mut import = to.import_stream().unwrap();
    import.push(&bytes[..rows_at]).unwrap();
    let mut sequence = pool.import_sequence_stream();
    sequence.push(&bytes[..rows_at]).unwrap();
    {
        let _cap = Cap::room(24 << 20);
        let mut filler = fill_device(g, 1 << 20);
        let refused = import.push(&bytes[rows_at..]).unwrap_err();
        // The refused import let go of its staging: that room is filled too.
        filler.extend(fill_device(g, 1 << 20));
        for e in [refused, sequence.push(&bytes[rows_at..]).unwrap_err()] {
            assert!(
                matches!(&e, Error::OutOfMemory { what, bytes, .. }
                    if what == "the snapshot's rows" && *bytes >= 8 << 20),
                "{e}"
            );
            eprintln!("refused: {e}");
        }
        drop(filler);
    }
    drop((import, sequence));
    assert_eq!(to.len(), 0);
    assert_eq!(pool.free_pages(), n / 64, "the refused import took pages");
    // With room, the same pieces import every row.
    let mut import = to.import_stream().unwrap();
    import.push(&bytes[..rows_at]).unwrap();
    import.push(&bytes[rows_at..]).unwrap();
    assert_eq!(import.finish().unwrap(), n);
    assert_eq!(to.read_f32(0, 0).unwrap(), d);
    let mut sequence = pool.import_sequence_stream();
    sequence.push(&bytes[..rows_at]).unwrap();
    sequence.push(&bytes[rows_at..]).unwrap();
    let seq = sequence.finish().unwrap();
    assert_eq!(
        pollster::block_on(pool.read_f32_async(seq, 0, 0)).unwrap(),
        d
    );
    lost.assert_none();
}

#[test]
fn a_batch_naming_more_queries_than_given_is_refused_before_its_query_table_is_built() {
    let _serial = serial();
    let g = gpu();
    // 2^20 entries of 64 queries each against one query given: the query table of their 2^26
    // queries (8 bytes each) would take 512 MiB. Built before the counts were checked, it would
    // have to fit the cap below (a host allocation past it aborts the process).
    let spec = CacheSpec::new(vec![LayerSpec::kv(1, 4, 4)], DType::F32, 64).unwrap();
    let mut pool = PagedCache::new(&g.device, &g.queue, spec, 16, 8).unwrap();
    let (a, b) = (pool.add_sequence().unwrap(), pool.add_sequence().unwrap());
    let rows = values(13, 64 * 4);
    for (seq, n) in [(a, 64), (b, 1)] {
        let shape = [n, 1, 4];
        let slab = HostSlab::f32(&rows[..n * 4], &shape);
        pool.append(seq, 0, &[slab, slab]).unwrap();
        pool.advance(seq, n).unwrap();
    }
    let q = pollster::block_on(f32_buffer(&g.device, &values(14, 4)));
    let out = pollster::block_on(f32_buffer(&g.device, &[-1.0; 4]));
    let mut batch = vec![(a, 64); 1 << 20];
    batch.push((b, 1));
    let mut att = Attention::with_kernels(pool.kernels().clone());
    let e = {
        let _cap = Cap::room(64 << 20);
        att.gqa(
            Kv::Batch(&pool, &batch),
            0,
            Queries::new(&q, 1, 1, 4),
            &out,
            &AttentionOptions::default(),
        )
        .unwrap_err()
    };
    assert!(
        matches!(&e, Error::AttentionRequest {
            problem: AttentionProblem::BatchRows { batch, queries: 1 }, ..
        } if *batch == (64 << 20) + 1),
        "{e}"
    );
    assert_eq!(pollster::block_on(read_f32(g, &out)), [-1.0; 4]);
}

#[test]
fn dispatches_whose_parameter_buffer_the_device_cannot_make_are_refused_and_change_nothing() {
    let _serial = serial();
    let g = gpu();
    if !reports_host_memory(g) {
        return;
    }
    // A cache and an attention stage their dispatches' parameters in a ring of uniform buffers
    // (about 176-256 KiB each), the first made at the first call that dispatches, the next when
    // one is used up: on a device without room for one, the call is refused before it writes or
    // records anything.
    let spec = CacheSpec::new(vec![LayerSpec::kv(2, 8, 8)], DType::F16, 16).unwrap();
    let mut c = cache(spec);
    let d = values(15, 3 * 2 * 8);
    let shape = [3, 2, 8];
    c.append(0, &[HostSlab::f32(&d, &shape); 2]).unwrap();
    c.advance(3).unwrap();
    let as_f16 =
        |x: &[f32]| -> Vec<f32> { x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect() };
    // An f32 source into f16 slots takes the converting kernel, which has parameters.
    let src = pollster::block_on(f32_buffer(&g.device, &d));
    let gpu_slab = GpuSlab::contiguous(&src, DType::F32, &shape);
    let q = pollster::block_on(f32_buffer(&g.device, &values(16, 4 * 8)));
    let out = |fill: f32| pollster::block_on(f32_buffer(&g.device, &[fill; 4 * 8]));
    let (want, got) = (out(0.0), out(-1.0));
    let call = |att: &mut Attention, c: &KvCache, to: &wgpu::Buffer| {
        att.gqa(
            c,
            0,
            Queries::new(&q, 1, 4, 8),
            to,
            &AttentionOptions::default(),
        )
    };
    // This attention makes its scratch and its first parameter buffer with room.
    let mut att = Attention::with_kernels(c.kernels().clone());
    call(&mut att, &c, &got).unwrap();
    let lost = Losses::default();
    lost.watch(&g.device);
    let ring = |e: Error| {
        assert!(
            matches!(&e, Error::OutOfMemory { what, .. } if what == "the parameter ring"),
            "{e}"
        );
        eprintln!("refused: {e}");
    };
    let attention_calls = {
        let _cap = Cap::room(16 << 20);
        let filler = fill_device(g, 64 << 10);
        ring(c.reset().unwrap_err());
        ring(c.truncate_and_scrub(1).unwrap_err());
        ring(c.append_gpu(0, &[gpu_slab; 2]).unwrap_err());
        // The attention's buffer has entries left for its first calls; the call that needs the
        // next buffer is refused.
        let mut calls = 0;
        let refused = loop {
            calls += 1;
            match call(&mut att, &c, &got) {
                Ok(()) => assert!(calls <= 1024, "no new parameter buffer after {calls} calls"),
                Err(e) => break e,
            }
        };
        ring(refused);
        drop(filler);
        calls
    };
    eprintln!("the attention's call {attention_calls} needed a new parameter buffer");
    assert!(attention_calls > 1, "its first buffer had entries left");
    assert_eq!(c.len(), 3, "a refused reset or scrub changed the length");
    assert_eq!(c.visible(0).unwrap(), 3, "a refused append landed");
    assert_eq!(
        c.read_f32(0, 0).unwrap(),
        as_f16(&d),
        "a refused call wrote"
    );
    // With room, the same calls land: the attention computes what a fresh one does.
    call(&mut att, &c, &got).unwrap();
    call(&mut Attention::with_kernels(c.kernels().clone()), &c, &want).unwrap();
    assert_eq!(
        pollster::block_on(read_f32(g, &got)),
        pollster::block_on(read_f32(g, &want))
    );
    c.append_gpu(0, &[gpu_slab; 2]).unwrap();
    c.advance(3).unwrap();
    assert_eq!(c.read_f32(0, 1).unwrap()[3 * 16..], as_f16(&d)[..]);
    c.truncate_and_scrub(3).unwrap();
    c.reset().unwrap();
    assert_eq!(c.len(), 0);
    lost.assert_none();
}
