//! Row placement: the one place where rows of a slot become byte and word ranges of GPU memory.
//!
//! The ledger plans in [`Run`]s — rows `[first_row, first_row + n_rows)` of one page of a slot's
//! storage — and only [`Placement`] turns a run into offsets. A single-sequence cache has one page per
//! slot (its whole buffer), so every plan is one run; a paged pool's plans give a run per page
//! touched, and nothing else has to learn how pages lie in memory.

/// Rows `[first_row, first_row + n_rows)` of page `page` of a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// The page of the slot's storage (always 0 in a single-sequence cache: its buffer).
    pub page: usize,
    pub first_row: usize,
    pub n_rows: usize,
}

/// How the rows of one slot lie in its storage: whole rows of `row_bytes` (a multiple of 4), from byte
/// 0 of each page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Placement {
    pub row_bytes: u64,
}

impl Placement {
    /// Byte offset of `row` in its page.
    pub(crate) fn offset(&self, row: usize) -> u64 {
        row as u64 * self.row_bytes
    }

    /// Byte offset and size of a run in its page.
    pub(crate) fn bytes(&self, run: &Run) -> (u64, u64) {
        (
            self.offset(run.first_row),
            run.n_rows as u64 * self.row_bytes,
        )
    }

    /// First word and word count of a run in its page.
    pub(crate) fn words(&self, run: &Run) -> (u64, u64) {
        let (offset, size) = self.bytes(run);
        (offset / 4, size / 4)
    }
}

/// Where a paged sequence's rows lie: row `r` is row `r % page_size` of page
/// `table[table_base + r / page_size]` of a pool of `n_pages` pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Paging {
    pub page_size: usize,
    pub table_base: usize,
    pub n_pages: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_become_byte_and_word_ranges() {
        let p = Placement { row_bytes: 12 };
        let run = Run {
            page: 0,
            first_row: 3,
            n_rows: 2,
        };
        assert_eq!(p.bytes(&run), (36, 24));
        assert_eq!(p.words(&run), (9, 6));
    }
}
