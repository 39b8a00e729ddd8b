//! Recorded runs: the plot's series written into the JSON, and read back from it (`--plot-from`), so
//! a plot can be redrawn from a past run without measuring again.
//!
//! A JSON written by this bench carries `series`. Older ones (v0.1's `docs/benchmarks.json`) have only
//! result rows; their series are rebuilt from the rows' names, values and ratios, which hold every
//! point except the per-context raw `write_buffer` of the step chart (never recorded as rows).

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::decode::Series;

/// The plot's two charts in JSON: `{"steps": [{"name", "points": [[context, seconds], ...]}], "attention": [...]}`.
pub fn series_json(steps: &Series, attention: &Series) -> Value {
    let one = |s: &Series| -> Value {
        s.iter()
            .map(|(name, pts)| json!({ "name": name, "points": pts }))
            .collect()
    };
    json!({ "steps": one(steps), "attention": one(attention) })
}

/// A recorded run: the plot's title and its two series.
pub struct Recorded {
    pub title: String,
    pub steps: Series,
    pub attention: Series,
}

/// Reads a JSON written by this bench (or by v0.1's, see the module docs).
pub fn load(path: &str) -> Result<Recorded> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
    let doc: Value = serde_json::from_str(&text).with_context(|| format!("parsing {path}"))?;
    let field = |k: &str| doc.get(k).and_then(Value::as_str).unwrap_or("?");
    let title = format!("kvgpu on {} ({})", field("adapter"), field("backend"));
    let (steps, attention) = match doc.get("series") {
        Some(series) => (
            parse_series(&series["steps"])?,
            parse_series(&series["attention"])?,
        ),
        None => {
            let rows = doc["results"]
                .as_array()
                .with_context(|| format!("{path} has neither `series` nor `results`"))?;
            from_rows(rows)?
        }
    };
    if steps.is_empty() && attention.is_empty() {
        bail!("{path} holds no plottable results");
    }
    Ok(Recorded {
        title,
        steps,
        attention,
    })
}

fn parse_series(v: &Value) -> Result<Series> {
    let mut out = Series::new();
    for s in v.as_array().map(Vec::as_slice).unwrap_or_default() {
        let name = s["name"].as_str().context("a series without a name")?;
        let mut pts = Vec::new();
        for p in s["points"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
        {
            match (p[0].as_u64(), p[1].as_f64()) {
                (Some(x), Some(y)) => pts.push((x as usize, y)),
                _ => bail!("series {name:?}: a point {p} is not [context, seconds]"),
            }
        }
        out.push((name.to_string(), pts));
    }
    Ok(out)
}

/// `"... ctx 4000..."` → 4000.
fn context_of(name: &str) -> Option<usize> {
    let rest = &name[name.find("ctx ")? + 4..];
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Adds `(ctx, seconds)` to the series `name`, creating it in first-seen order.
fn push(series: &mut Series, name: String, ctx: usize, seconds: f64) {
    match series.iter_mut().find(|(n, _)| *n == name) {
        Some((_, pts)) => pts.push((ctx, seconds)),
        None => series.push((name, vec![(ctx, seconds)])),
    }
}

/// Rebuilds the series from result rows, under the names the measuring code gives them. Each row's
/// value is kvgpu's figure and its ratio is kvgpu / peer (or peer / kvgpu for the prefix copy), so a
/// peer's time is value / ratio; kvgpu's attention times are its whole calls (the rows against candle).
fn from_rows(rows: &[Value]) -> Result<(Series, Series)> {
    let (mut steps, mut attention) = (Series::new(), Series::new());
    for r in rows {
        let name = r["name"].as_str().unwrap_or_default();
        let (Some(value), ratio) = (r["value"].as_f64(), r["ratio"].as_f64()) else {
            continue;
        };
        let Some(ctx) = context_of(name) else {
            continue;
        };
        let us = |v: f64| v * 1e-6;
        if name.starts_with("kvgpu / candle-nn KvCache append step") {
            push(
                &mut steps,
                "kvgpu append (Llama-3-8B f16, 32 layers)".into(),
                ctx,
                us(value),
            );
            if let Some(ratio) = ratio {
                push(
                    &mut steps,
                    "candle-nn KvCache (CPU f16)".into(),
                    ctx,
                    us(value / ratio),
                );
            }
        } else if name.starts_with("prefix-copy cache step") {
            push(&mut steps, "prefix-copy GPU cache".into(), ctx, us(value));
        } else if name.starts_with("kvgpu / Vec<f32> flat CPU cache step") {
            if let Some(ratio) = ratio {
                push(
                    &mut steps,
                    "Vec<f32> flat CPU cache".into(),
                    ctx,
                    us(value / ratio),
                );
            }
        } else if let Some(rest) = name.strip_prefix("kvgpu / candle CPU attention, ") {
            // "{GQA|MLA} <model> layer {dtype}, ctx N": kvgpu's whole call, and candle's.
            let kind = &rest[..3];
            let dtype = rest.split(',').next().and_then(|s| s.rsplit(' ').next());
            if let (Some(dtype), Some(ratio)) = (dtype, ratio) {
                push(
                    &mut attention,
                    format!("kvgpu {kind} {dtype} (call)"),
                    ctx,
                    us(value),
                );
                push(
                    &mut attention,
                    format!("candle {kind} {dtype} (CPU)"),
                    ctx,
                    us(value / ratio),
                );
            }
        }
    }
    for (_, pts) in steps.iter_mut().chain(attention.iter_mut()) {
        pts.sort_unstable_by_key(|p| p.0);
    }
    Ok((steps, attention))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_give_back_the_series_they_were_measured_as() {
        let rows = json!([
            {"name": "kvgpu / candle-nn KvCache append step, ctx 4000", "value": 300.0, "ratio": 3.0},
            {"name": "kvgpu / candle-nn KvCache append step, ctx 16", "value": 290.0, "ratio": 2.9},
            {"name": "prefix-copy cache step, ctx 4000", "value": 2000.0, "ratio": 6.6},
            {"name": "kvgpu / Vec<f32> flat CPU cache step, ctx 4000", "value": 300.0, "ratio": 50.0},
            {"name": "GQA Llama-3-8B layer attention f16, ctx 512: KV bandwidth", "value": 0.5, "ratio": 0.1,
             "reference": "streaming-read roofline over the same 2048 KiB (6.07 GB/s)"},
            {"name": "kvgpu / candle CPU attention, GQA Llama-3-8B layer f16, ctx 512", "value": 4000.0, "ratio": 2.0},
            {"name": "reset (zeroing) of a whole Llama-3-8B f16 cache, 1032 MiB", "value": 9.0, "ratio": 0.9}
        ]);
        let (steps, attention) = from_rows(rows.as_array().unwrap()).unwrap();
        let names: Vec<&str> = steps.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            names,
            [
                "kvgpu append (Llama-3-8B f16, 32 layers)",
                "candle-nn KvCache (CPU f16)",
                "prefix-copy GPU cache",
                "Vec<f32> flat CPU cache"
            ]
        );
        assert_eq!(steps[0].1, vec![(16, 290e-6), (4000, 300e-6)]);
        assert!((steps[1].1[1].1 - 100e-6).abs() < 1e-12);
        assert!((steps[3].1[0].1 - 6e-6).abs() < 1e-12);
        assert_eq!(attention[0].0, "kvgpu GQA f16 (call)");
        assert!((attention[0].1[0].1 - 4000e-6).abs() < 1e-12);
        assert_eq!(attention[1].0, "candle GQA f16 (CPU)");
        assert!((attention[1].1[0].1 - 2000e-6).abs() < 1e-12);
    }

    #[test]
    fn written_series_read_back_unchanged() {
        let steps: Series = vec![("a".into(), vec![(16, 1e-4), (4000, 2e-4)])];
        let attention: Series = vec![("b".into(), vec![(512, 3e-3)])];
        let v = series_json(&steps, &attention);
        assert_eq!(parse_series(&v["steps"]).unwrap(), steps);
        assert_eq!(parse_series(&v["attention"]).unwrap(), attention);
    }
}
