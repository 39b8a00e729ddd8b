//! The plot: cost per decode step against context length for kvgpu and the peers, and attention time
//! against context, one chart above the other (so it stays readable at a page's width). SVG, so no
//! system fonts are needed.
//!
//! One colour is one implementation in both charts (kvgpu blue, candle green, ...); in the attention
//! chart the marker tells GQA (circle) from MLA (triangle) and the line f32 (solid) from f16 (dashed).
//! Both axes are logarithmic; the x ticks are the measured contexts, the y ticks powers of ten with
//! units (`10 µs`, `1 ms`).

use anyhow::{Result, anyhow};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::decode::Series;

const WIDTH: u32 = 1000;
const CHART_HEIGHT: u32 = 560;

/// The colour of the implementation a series measures, by the start of its name.
fn colour(name: &str) -> RGBColor {
    const WHO: [(&str, RGBColor); 5] = [
        ("kvgpu", RGBColor(31, 119, 180)),
        ("candle", RGBColor(44, 160, 44)),
        ("raw write_buffer", RGBColor(127, 127, 127)),
        ("prefix-copy", RGBColor(214, 39, 40)),
        ("Vec<f32>", RGBColor(148, 103, 189)),
    ];
    WHO.iter()
        .find(|(who, _)| name.starts_with(who))
        .map_or(RGBColor(140, 86, 75), |(_, c)| *c)
}

/// How a series is drawn: its colour, a triangle (MLA) or circle marker, dashed (f16 attention) or not.
#[derive(Clone, Copy)]
struct Look {
    colour: RGBColor,
    triangle: bool,
    dashed: bool,
}

fn look(name: &str) -> Look {
    Look {
        colour: colour(name),
        triangle: name.contains(" MLA "),
        dashed: name.contains(" f16 "),
    }
}

/// `1e-5` → `10 µs`, `2.5e-3` → `2.5 ms`.
fn time_label(seconds: f64) -> String {
    let (v, unit) = if seconds >= 1.0 {
        (seconds, "s")
    } else if seconds >= 1e-3 {
        (seconds * 1e3, "ms")
    } else {
        (seconds * 1e6, "µs")
    };
    let s = format!("{v:.2}");
    format!("{} {unit}", s.trim_end_matches('0').trim_end_matches('.'))
}

/// Powers of ten covering `[lo, hi]`.
fn decades(lo: f64, hi: f64) -> Vec<f64> {
    let (a, b) = (lo.log10().floor() as i32, hi.log10().ceil() as i32);
    (a..=b).map(|e| 10f64.powi(e)).collect()
}

fn chart(
    area: &DrawingArea<SVGBackend<'_>, Shift>,
    title: &str,
    series: &Series,
    legend_at: SeriesLabelPosition,
) -> Result<()> {
    let pts = || series.iter().flat_map(|(_, p)| p.iter());
    let (mut x_min, mut x_max) = (usize::MAX, 1usize);
    let (mut y_min, mut y_max) = (f64::INFINITY, 0f64);
    for &(x, y) in pts() {
        x_min = x_min.min(x.max(1));
        x_max = x_max.max(x);
        y_min = y_min.min(y);
        y_max = y_max.max(y);
    }
    if !y_min.is_finite() || y_min <= 0.0 {
        return Ok(());
    }
    let mut contexts: Vec<f64> = pts().map(|&(x, _)| x as f64).collect();
    contexts.sort_by(f64::total_cmp);
    contexts.dedup();
    // The axes start where the data start: a little margin around the measured range.
    let x_range = (x_min as f64 / 1.25)..(x_max as f64 * 1.25);
    let y_range = (y_min / 1.6)..(y_max * 1.6);
    let y_ticks: Vec<f64> = decades(y_range.start, y_range.end)
        .into_iter()
        .filter(|t| y_range.contains(t))
        .collect();
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("plot: {e:?}");
    let mut c = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .margin_right(28)
        .x_label_area_size(52)
        .y_label_area_size(96)
        .build_cartesian_2d(
            x_range.log_scale().with_key_points(contexts),
            y_range.log_scale().with_key_points(y_ticks),
        )
        .map_err(err)?;
    let x_fmt = |x: &f64| format!("{x:.0}");
    let y_fmt = |y: &f64| time_label(*y);
    c.configure_mesh()
        .x_desc("context length, tokens (log scale)")
        .y_desc("time (log scale), lower is better")
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .label_style(("sans-serif", 16))
        .axis_desc_style(("sans-serif", 17))
        .light_line_style(WHITE)
        .bold_line_style(BLACK.mix(0.12))
        .draw()
        .map_err(err)?;
    for (name, pts) in series {
        let lk = look(name);
        let line: Vec<(f64, f64)> = pts.iter().map(|&(x, y)| (x as f64, y)).collect();
        let stroke = lk.colour.stroke_width(2);
        let drawn = if lk.dashed {
            c.draw_series(DashedLineSeries::new(line.clone(), 9, 6, stroke))
        } else {
            c.draw_series(LineSeries::new(line.clone(), stroke))
        };
        let anno = drawn.map_err(err)?.label(name.as_str());
        // The legend's sample, relative to (x, y): the line (three dashes for f16), the marker on it.
        let d: [(i32, i32); 3] = if lk.dashed {
            [(0, 8), (15, 25), (32, 40)]
        } else {
            [(0, 15), (15, 25), (25, 40)]
        };
        let sample = move |(x, y)| {
            EmptyElement::at((x, y))
                + PathElement::new(vec![(d[0].0, 0), (d[0].1, 0)], stroke)
                + PathElement::new(vec![(d[1].0, 0), (d[1].1, 0)], stroke)
                + PathElement::new(vec![(d[2].0, 0), (d[2].1, 0)], stroke)
        };
        let fill = lk.colour.filled();
        if lk.triangle {
            anno.legend(move |p| sample(p) + TriangleMarker::new((20, 0), 6, fill));
        } else {
            anno.legend(move |p| sample(p) + Circle::new((20, 0), 4, fill));
        }
        if lk.triangle {
            c.draw_series(
                line.iter()
                    .map(|&p| TriangleMarker::new(p, 6, lk.colour.filled())),
            )
            .map_err(err)?;
        } else {
            c.draw_series(line.iter().map(|&p| Circle::new(p, 4, lk.colour.filled())))
                .map_err(err)?;
        }
    }
    c.configure_series_labels()
        .position(legend_at)
        .legend_area_size(52)
        .label_font(("sans-serif", 16))
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK.mix(0.4))
        .draw()
        .map_err(err)?;
    Ok(())
}

/// Writes the step-cost chart and, when attention was measured, the attention chart below it.
pub fn write(path: &str, title: &str, steps: &Series, attention: &Series) -> Result<()> {
    let height = if attention.is_empty() {
        CHART_HEIGHT + 40
    } else {
        2 * CHART_HEIGHT + 40
    };
    let root = SVGBackend::new(path, (WIDTH, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("plot: {e:?}"))?;
    let body = root
        .titled(
            &format!("{title}: time per operation, lower is better"),
            ("sans-serif", 24),
        )
        .map_err(|e| anyhow!("plot: {e:?}"))?;
    let step_title = "decode step: append one token to every layer";
    if attention.is_empty() {
        chart(&body, step_title, steps, SeriesLabelPosition::UpperLeft)?;
    } else {
        let halves = body.split_evenly((2, 1));
        chart(
            &halves[0],
            step_title,
            steps,
            SeriesLabelPosition::UpperLeft,
        )?;
        // Lower right: the attention lines rise to the right, so that corner is free.
        chart(
            &halves[1],
            "decode attention: one layer, one query",
            attention,
            SeriesLabelPosition::LowerRight,
        )?;
    }
    root.present().map_err(|e| anyhow!("plot: {e:?}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text of every `<text>` element of an SVG, in order.
    fn texts(svg: &str) -> Vec<String> {
        svg.split("<text")
            .skip(1)
            .filter_map(|t| {
                let body = &t[t.find('>')? + 1..];
                Some(body[..body.find("</text>")?].trim().to_string())
            })
            .collect()
    }

    #[test]
    fn time_ticks_carry_units_and_no_trailing_zeros() {
        assert_eq!(time_label(1e-5), "10 µs");
        assert_eq!(time_label(1e-4), "100 µs");
        assert_eq!(time_label(2.5e-3), "2.5 ms");
        assert_eq!(time_label(0.1), "100 ms");
        assert_eq!(time_label(1.0), "1 s");
        assert_eq!(decades(3e-4, 2e-2), vec![1e-4, 1e-3, 1e-2, 1e-1]);
    }

    #[test]
    fn axes_start_at_the_data_colours_follow_the_implementation() {
        let steps: Series = vec![
            (
                "kvgpu append (Llama-3-8B f16, 32 layers)".into(),
                vec![(16, 3e-4), (8000, 3e-4)],
            ),
            (
                "candle-nn KvCache (CPU f16)".into(),
                vec![(16, 8e-5), (8000, 9e-5)],
            ),
        ];
        let attention: Series = vec![
            (
                "kvgpu GQA f16 (call)".into(),
                vec![(512, 4e-3), (16384, 0.13)],
            ),
            (
                "candle GQA f16 (CPU)".into(),
                vec![(512, 1.7e-3), (16384, 4e-2)],
            ),
        ];
        let path = std::env::temp_dir().join(format!("kvgpu-plot-test-{}.svg", std::process::id()));
        let path = path.to_str().unwrap();
        write(path, "test", &steps, &attention).unwrap();
        let svg = std::fs::read_to_string(path).unwrap();
        std::fs::remove_file(path).unwrap();
        let t = texts(&svg);
        // The attention chart's x ticks are its contexts: it starts at 512, not at the step chart's 16.
        let at = t
            .iter()
            .position(|s| s.starts_with("decode attention"))
            .unwrap();
        let ticks: Vec<&str> = t[at..]
            .iter()
            .map(String::as_str)
            .filter(|s| s.parse::<u32>().is_ok())
            .collect();
        assert_eq!(ticks, ["512", "16384"]);
        assert!(t.iter().all(|s| !s.ends_with(".0")), "{t:?}");
        assert!(t.iter().any(|s| s == "10 ms"), "{t:?}");
        assert!(t.iter().any(|s| s.contains("lower is better")));
        // kvgpu is blue and candle green in both charts.
        assert_eq!(
            colour("kvgpu append (Llama-3-8B f16, 32 layers)"),
            colour("kvgpu GQA f16 (call)")
        );
        assert_eq!(
            colour("candle-nn KvCache (CPU f16)"),
            colour("candle GQA f16 (CPU)")
        );
        assert_ne!(
            colour("kvgpu GQA f16 (call)"),
            colour("candle GQA f16 (CPU)")
        );
    }
}
