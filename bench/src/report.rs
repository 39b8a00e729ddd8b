//! Result rows: the table printed at the end and `bench-results.json`.

use serde_json::{Value, json};

use crate::timing::Clock;

/// What a ratio should reach; `Info` rows have no goal.
#[derive(Clone, Copy, Debug)]
pub enum Goal {
    AtMost(f64),
    AtLeast(f64),
    /// At least the first, at most the second (a bandwidth against a roofline: above 1.0 the
    /// roofline would not be one).
    Within(f64, f64),
    Info,
}

impl Goal {
    pub fn text(self) -> String {
        match self {
            Goal::AtMost(g) => format!("ratio <= {g}"),
            Goal::AtLeast(g) => format!("ratio >= {g}"),
            Goal::Within(lo, hi) => format!("{lo} <= ratio <= {hi}"),
            Goal::Info => "none (context)".into(),
        }
    }

    pub fn met(self, ratio: f64) -> Option<bool> {
        match self {
            Goal::AtMost(g) => Some(ratio <= g),
            Goal::AtLeast(g) => Some(ratio >= g),
            Goal::Within(lo, hi) => Some((lo..=hi).contains(&ratio)),
            Goal::Info => None,
        }
    }
}

/// One measured figure and its ratio to a reference measured in the same run.
#[derive(Clone, Debug)]
pub struct Row {
    pub name: String,
    pub value: f64,
    pub unit: &'static str,
    pub ratio: Option<f64>,
    pub reference: String,
    pub goal: Goal,
    pub clock: Clock,
}

impl Row {
    pub fn new(name: impl Into<String>, value: f64, unit: &'static str, clock: Clock) -> Self {
        Self {
            name: name.into(),
            value,
            unit,
            ratio: None,
            reference: String::new(),
            goal: Goal::Info,
            clock,
        }
    }

    pub fn ratio(mut self, ratio: f64, reference: impl Into<String>, goal: Goal) -> Self {
        self.ratio = Some(ratio);
        self.reference = reference.into();
        self.goal = goal;
        self
    }

    fn met(&self) -> Option<bool> {
        self.ratio.and_then(|r| self.goal.met(r))
    }

    pub fn json(&self) -> Value {
        let num = |x: f64| if x.is_finite() { json!(x) } else { Value::Null };
        json!({
            "name": self.name,
            "value": num(self.value),
            "unit": self.unit,
            "ratio": self.ratio.map_or(Value::Null, num),
            "reference": self.reference,
            "goal": self.goal.text(),
            "met": self.met(),
            "timing": self.clock.name(),
        })
    }
}

fn fmt_value(v: f64) -> String {
    if !v.is_finite() {
        "-".into()
    } else if v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.4}")
    }
}

/// The rows as a Markdown table.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| figure | value | unit | ratio | reference | goal | met |\n|---|---:|---|---:|---|---|---|\n",
    );
    for r in rows {
        let met = match r.met() {
            Some(true) => "yes",
            Some(false) => "**no**",
            None => "",
        };
        out += &format!(
            "| {} | {} | {} | {} | {} | {} | {} |\n",
            r.name,
            fmt_value(r.value),
            r.unit,
            r.ratio.map_or("-".into(), |x| format!("{x:.3}")),
            r.reference,
            match r.goal {
                Goal::Info => String::new(),
                g => g.text(),
            },
            met
        );
    }
    out
}
