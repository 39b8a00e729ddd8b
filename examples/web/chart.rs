//! The page's chart, as inline SVG: time per decode step and cache memory against the cache length.
//! Plain strings, no JS: the page sets it as the chart box's HTML.

use std::fmt::Write;

/// One decode step: the cache length after it, its time, and the bytes the cache's views cover.
#[derive(Clone, Copy, Debug)]
pub struct StepPoint {
    pub len: usize,
    pub ms: f64,
    pub bytes_in_use: u64,
}

const TIME: &str = "#1f77b4";
const IN_USE: &str = "#2ca02c";
const ALLOCATED: &str = "#7f7f7f";

const PANEL_W: f64 = 380.0;
const HEIGHT: f64 = 280.0;
const LEFT: f64 = 62.0;
const RIGHT: f64 = 14.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 44.0;

/// A tick step of 1, 2 or 5 times a power of ten giving about four intervals over `span`.
fn tick_step(span: f64) -> f64 {
    let raw = (span / 4.0).max(f64::MIN_POSITIVE);
    let pow = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * pow)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * pow)
}

/// Ticks from the first multiple of the step at or above `lo` up to `hi`.
fn ticks(lo: f64, hi: f64) -> Vec<f64> {
    let step = tick_step(hi - lo);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 && out.len() < 12 {
        out.push(t);
        t += step;
    }
    out
}

/// A number without trailing zeros: 0.25, 2, 1500.
fn num(x: f64) -> String {
    let s = format!("{x:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" { "0".into() } else { s.into() }
}

/// The median of `v` (0 when empty).
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    match s.len() {
        0 => 0.0,
        n if n % 2 == 1 => s[n / 2],
        n => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

/// Bytes in KiB or MiB, whichever reads better at this size.
fn bytes_unit(max: f64) -> (f64, &'static str) {
    if max >= 4.0 * 1024.0 * 1024.0 {
        (1024.0 * 1024.0, "MiB")
    } else {
        (1024.0, "KiB")
    }
}

/// One panel: axes, ticks, a title and the lines `(values, colour, id, dashed)` over `xs`.
struct Panel<'a> {
    x0: f64,
    title: &'a str,
    xs: &'a [f64],
    y_max: f64,
    /// Divides the values for the tick labels (1024 for KiB), so ticks fall on round labels.
    y_unit: f64,
}

impl Panel<'_> {
    fn sx(&self, x: f64) -> f64 {
        let (lo, hi) = (self.xs[0], self.xs[self.xs.len() - 1]);
        let span = if hi > lo { hi - lo } else { 1.0 };
        self.x0 + LEFT + (x - lo) / span * (PANEL_W - LEFT - RIGHT)
    }

    fn sy(&self, y: f64) -> f64 {
        HEIGHT - BOTTOM - y / self.y_max * (HEIGHT - TOP - BOTTOM)
    }

    fn frame(&self, svg: &mut String) {
        let (l, r) = (self.x0 + LEFT, self.x0 + PANEL_W - RIGHT);
        let (t, b) = (TOP, HEIGHT - BOTTOM);
        let _ = write!(
            svg,
            r#"<text x="{:.1}" y="22" font-size="14" font-weight="bold">{}</text>"#,
            self.x0 + 8.0,
            self.title
        );
        for label in ticks(0.0, self.y_max / self.y_unit) {
            let py = self.sy(label * self.y_unit);
            let _ = write!(
                svg,
                r##"<line x1="{l:.1}" y1="{py:.1}" x2="{r:.1}" y2="{py:.1}" stroke="#e0e0e0"/><text x="{:.1}" y="{:.1}" font-size="12" text-anchor="end">{}</text>"##,
                l - 6.0,
                py + 4.0,
                num(label)
            );
        }
        let (lo, hi) = (self.xs[0], self.xs[self.xs.len() - 1]);
        for x in ticks(lo, hi) {
            let px = self.sx(x);
            let _ = write!(
                svg,
                r##"<line x1="{px:.1}" y1="{b:.1}" x2="{px:.1}" y2="{:.1}" stroke="#000"/><text x="{px:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"##,
                b + 5.0,
                b + 19.0,
                num(x)
            );
        }
        let _ = write!(
            svg,
            r##"<path d="M{l:.1} {t:.1} V{b:.1} H{r:.1}" fill="none" stroke="#000"/><text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">cache length (tokens)</text>"##,
            (l + r) / 2.0,
            HEIGHT - 8.0
        );
    }

    fn line(&self, svg: &mut String, ys: &[f64], colour: &str, id: &str, dashed: bool) {
        let pts: Vec<String> = self
            .xs
            .iter()
            .zip(ys)
            .map(|(&x, &y)| format!("{:.1},{:.1}", self.sx(x), self.sy(y)))
            .collect();
        let dash = if dashed {
            r#" stroke-dasharray="6 4""#
        } else {
            ""
        };
        let _ = write!(
            svg,
            r#"<polyline id="{id}" data-points="{}" points="{}" fill="none" stroke="{colour}" stroke-width="2.5"{dash}/>"#,
            pts.len(),
            pts.join(" ")
        );
    }
}

/// The two panels side by side: milliseconds per decode step (lower is better), and the bytes the
/// cache's visible rows take (from empty through the prefill and every decode step) against the bytes
/// it allocated. `prefill` is the prefill's length. Empty when there is no step.
pub fn svg(prefill: usize, steps: &[StepPoint], allocated: u64) -> String {
    if steps.is_empty() {
        return String::new();
    }
    let w = 2.0 * PANEL_W;
    let mut svg = format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" id="chart-svg" width="{w}" height="{HEIGHT}" viewBox="0 0 {w} {HEIGHT}" font-family="sans-serif" role="img" aria-label="time per decode step and cache memory"><rect width="{w}" height="{HEIGHT}" fill="#fff"/>"##
    );

    let xs: Vec<f64> = steps.iter().map(|p| p.len as f64).collect();
    let times: Vec<f64> = steps.iter().map(|p| p.ms).collect();
    // A step far slower than the rest (one that built a pipeline variant on first use) would flatten
    // the others: the axis stops at 4x the median and such a step is drawn at the top, labelled.
    let slowest = times.iter().copied().fold(0.0, f64::max).max(1e-3);
    let limit = 4.0 * median(&times).max(1e-3);
    let t_max = slowest.min(limit) * 1.15;
    let shown: Vec<f64> = times.iter().map(|&t| t.min(t_max)).collect();
    let time = Panel {
        x0: 0.0,
        title: "ms per decode step (lower is better)",
        xs: &xs,
        y_max: t_max,
        y_unit: 1.0,
    };
    time.frame(&mut svg);
    time.line(&mut svg, &shown, TIME, "time-line", false);
    for ((&x, &y), &t) in xs.iter().zip(&shown).zip(&times) {
        let (px, py) = (time.sx(x), time.sy(y));
        let _ = write!(
            svg,
            r#"<circle cx="{px:.1}" cy="{py:.1}" r="2.5" fill="{TIME}"/>"#
        );
        if t > t_max {
            let _ = write!(
                svg,
                r#"<text x="{:.1}" y="{:.1}" font-size="11" fill="{TIME}">↑ {} ms</text>"#,
                px + 5.0,
                py + 12.0,
                num(t.round())
            );
        }
    }

    // Memory from the empty cache: 0, the prefill's rows, then each decode step.
    let per_token = steps[0].bytes_in_use as f64 / steps[0].len.max(1) as f64;
    let mut mxs = vec![0.0, prefill as f64];
    let mut in_use = vec![0.0, prefill as f64 * per_token];
    mxs.extend(&xs);
    in_use.extend(steps.iter().map(|p| p.bytes_in_use as f64));
    let (div, unit) = bytes_unit(allocated as f64);
    let m_max = (allocated as f64).max(in_use.iter().copied().fold(0.0, f64::max)) * 1.15;
    let title = format!("cache memory, {unit}");
    let memory = Panel {
        x0: PANEL_W,
        title: &title,
        xs: &mxs,
        y_max: m_max.max(1.0),
        y_unit: div,
    };
    memory.frame(&mut svg);
    memory.line(
        &mut svg,
        &vec![allocated as f64; mxs.len()],
        ALLOCATED,
        "allocated-line",
        true,
    );
    memory.line(&mut svg, &in_use, IN_USE, "memory-line", false);
    let lx = PANEL_W + LEFT + 8.0;
    let _ = write!(
        svg,
        r#"<rect x="{lx:.1}" y="{:.1}" width="18" height="3" fill="{ALLOCATED}"/><text x="{:.1}" y="{:.1}" font-size="12">allocated</text><rect x="{:.1}" y="{:.1}" width="18" height="3" fill="{IN_USE}"/><text x="{:.1}" y="{:.1}" font-size="12">in use (visible rows)</text>"#,
        TOP - 9.0,
        lx + 24.0,
        TOP - 4.0,
        lx + 100.0,
        TOP - 9.0,
        lx + 124.0,
        TOP - 4.0,
    );
    svg.push_str("</svg>");
    svg
}
