mod common;
use common::*;
use kvgpu::*;

#[test]
fn mla_append_and_read_back() {
    for_each_dtype(|dtype| {
        let spec = CacheSpec::new(vec![LayerSpec::mla(5, 3)], dtype, 8).unwrap();
        let mut c = cache(spec);
        let a = values(1, 2 * 5);
        let b = values(2, 2 * 3);
        c.append(0, &[HostSlab::f32(&a, &[2, 5]), HostSlab::f32(&b, &[2, 3])])
            .unwrap();
        c.advance(2).unwrap();
        let want: Vec<f32> = a.iter().map(|&x| reference::round_trip(x, dtype)).collect();
        assert_eq!(c.read_f32(0, 0).unwrap(), want);
        c.reset();
        assert!(c.read_full_words(0, 1).unwrap().iter().all(|&w| w == 0));
    });
}
