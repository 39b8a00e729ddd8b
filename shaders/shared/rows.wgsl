// How pass 1 of attention finds a query's rows; build.rs prepends this file (after the prelude) to
// attention_partial.wgsl, and src/attention/stream.rs to every kernel it generates. The kernel
// declares ROWS (0: the visible rows of one cache, its queries the last n_q; 1: the same through one
// sequence's page table, from entry p.table_base; 2: a ragged batch of sequences, each query's own
// row and first table entry in the query table at p.table_base of `stats`, each word plus 2^23 so
// that as an f32 it is normal: src/attention/plan.rs, QUERY_TABLE_BIAS), and the bindings `table`
// (the page table), `stats` and `p`.

// Query qi's own row: the last row it sees.
fn query_last(qi: u32) -> u32 {
    if ROWS == 2u {
        return bitcast<u32>(stats[p.table_base + 2u * qi]) - 0x00800000u;
    }
    return p.visible - p.n_q + qi;
}

// Query qi's first page-table entry.
fn query_table(qi: u32) -> u32 {
    if ROWS == 2u {
        return bitcast<u32>(stats[p.table_base + 2u * qi + 1u]) - 0x00800000u;
    }
    return p.table_base;
}

// The stored row of row `r` of a sequence whose page-table entries start at `tb` (every entry
// clamped below the pool's pages).
fn stored(r: u32, tb: u32) -> u32 {
    if ROWS == 0u {
        return r;
    }
    let page = min(table[tb + r / p.page_size], p.n_pages - 1u);
    return page * p.page_size + r % p.page_size;
}

// The rows a dispatch may read of a slot of `rw` words per row fit its binding of `len` words: the
// visible rows, or every row of the pool's pages (and, for one sequence, its table entries).
fn rows_fit(rw: u32, len: u32) -> bool {
    if ROWS == 0u {
        return p.visible <= len / max(rw, 1u);
    }
    return pool_fits(p.page_size, p.n_pages, rw, len)
        && (ROWS == 2u || table_fits(p.table_base, p.visible, p.page_size, arrayLength(&table)));
}

// The queries fit the rows (one sequence), or the query table lies in `stats` after the partial
// results this dispatch writes (`parts` of them).
fn queries_fit(parts: u32) -> bool {
    if ROWS != 2u {
        return p.n_q >= 1u && p.n_q <= p.visible;
    }
    let len = arrayLength(&stats);
    return p.n_q >= 1u && p.table_base >= parts * 2u && p.table_base <= len
        && p.n_q <= (len - p.table_base) / 2u;
}

// One query's row and table entries lie within the rows and the table (checked per query in a batch).
fn query_fits(last: u32, tb: u32) -> bool {
    if ROWS != 2u {
        return true;
    }
    return last < p.visible && table_fits(tb, last + 1u, p.page_size, arrayLength(&table));
}
