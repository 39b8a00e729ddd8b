//! The plot: cost per decode step against context length for kvgpu and the peers, and attention time
//! against context. SVG, so no system fonts are needed.

use anyhow::{Result, anyhow};
use plotters::prelude::*;

use crate::decode::Series;

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(127, 127, 127),
    RGBColor(23, 190, 207),
];

fn chart(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    title: &str,
    series: &Series,
) -> Result<()> {
    let pts = series.iter().flat_map(|(_, p)| p.iter());
    let (mut x_max, mut y_min, mut y_max) = (1usize, f64::INFINITY, 0f64);
    for &(x, y) in pts {
        x_max = x_max.max(x);
        y_min = y_min.min(y * 1e6);
        y_max = y_max.max(y * 1e6);
    }
    if !y_min.is_finite() {
        return Ok(());
    }
    let err = |e: DrawingAreaErrorKind<_>| anyhow!("plot: {e:?}");
    let mut c = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(60)
        .build_cartesian_2d(
            (8f64..(x_max as f64 * 1.3)).log_scale(),
            ((y_min * 0.5).max(1e-3)..y_max * 2.0).log_scale(),
        )
        .map_err(err)?;
    c.configure_mesh()
        .x_desc("context length (tokens)")
        .y_desc("microseconds (log)")
        .draw()
        .map_err(err)?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let line: Vec<(f64, f64)> = pts.iter().map(|&(x, y)| (x as f64, y * 1e6)).collect();
        c.draw_series(LineSeries::new(line.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], color.stroke_width(2))
            });
        c.draw_series(line.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(err)?;
    }
    c.configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}

/// Writes the step-cost chart and, when attention was measured, the attention chart beside it.
pub fn write(path: &str, title: &str, steps: &Series, attention: &Series) -> Result<()> {
    let width = if attention.is_empty() { 900 } else { 1800 };
    let root = SVGBackend::new(path, (width, 620)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("plot: {e:?}"))?;
    let title_area = root
        .titled(title, ("sans-serif", 20))
        .map_err(|e| anyhow!("plot: {e:?}"))?;
    if attention.is_empty() {
        chart(
            &title_area,
            "decode step: append one token to every layer",
            steps,
        )?;
    } else {
        let halves = title_area.split_evenly((1, 2));
        chart(
            &halves[0],
            "decode step: append one token to every layer",
            steps,
        )?;
        chart(
            &halves[1],
            "decode attention, one layer, one query",
            attention,
        )?;
    }
    root.present().map_err(|e| anyhow!("plot: {e:?}"))?;
    Ok(())
}
