#include "kvflash/pager.h"

#include "kvflash/limits.h"

#include <algorithm>
#include <cassert>
#include <cmath>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace kvflash {

static constexpr uint16_t kF16Zero = 0x0000, kF16NegInf = 0xFC00;
static constexpr float kUnscored = std::numeric_limits<float>::infinity();

int32_t PagerConfig::min_pool_tokens() const {
    const int64_t t = int64_t(sink_chunks + tail_window_chunks + 2) * chunk_tokens;
    return int32_t((t + 255) / 256 * 256);
}

void PagerConfig::validate() {
    if (chunk_tokens <= 0 || chunk_tokens > 4096)
        throw std::invalid_argument("chunk_tokens must be in [1, 4096], got " + std::to_string(chunk_tokens));
    if (256 % chunk_tokens != 0 && chunk_tokens % 256 != 0)
        throw std::invalid_argument("chunk_tokens must divide 256 or be a multiple of it (pool rows are padded to 256), got " +
                                    std::to_string(chunk_tokens));
    if (sink_chunks < 0) throw std::invalid_argument("sink_chunks must be >= 0");
    if (tail_window_chunks < 0) throw std::invalid_argument("tail_window_chunks must be >= 0");
    if (max_host_bytes < 0) throw std::invalid_argument("max_host_bytes must be >= 0 (0: no cap)");
    check_max_ctx(max_ctx);
    const int32_t minp = min_pool_tokens();
    if (pool_tokens <= 0)
        throw std::invalid_argument("pool_tokens must be positive; the minimum for this config is " +
                                    std::to_string(minp));
    if (pool_tokens % chunk_tokens != 0)
        throw std::invalid_argument("pool_tokens (" + std::to_string(pool_tokens) +
                                    ") must be a whole number of " + std::to_string(chunk_tokens) +
                                    "-token chunks; the minimum is " + std::to_string(minp));
    if (pool_tokens < minp)
        throw std::invalid_argument("pool_tokens " + std::to_string(pool_tokens) + " is below the minimum " +
                                    std::to_string(minp) + " ((sink_chunks + tail_window_chunks + 2) * chunk_tokens, rounded up to 256)");
    pool_tokens = (pool_tokens + 255) / 256 * 256;
}

Pager::Pager(PagerConfig cfg, ChunkMover *mover, HostStore::Backing backing, std::string host_path,
             HostAllocator host_alloc)
    : cfg_(cfg), mover_(mover) {
    cfg_.validate();
    if (!mover_) throw std::invalid_argument("pager: a chunk mover is required");
    host_ = std::make_unique<HostStore>(mover_->chunk_bytes(), backing, std::move(host_path), 16, host_alloc,
                                        size_t(cfg_.max_host_bytes));
    n_blocks_ = cfg_.pool_tokens / cfg_.chunk_tokens;
    n_chunks_ = int32_t((cfg_.max_ctx + cfg_.chunk_tokens - 1) / cfg_.chunk_tokens);
    words_ = (cfg_.chunk_tokens + 63) / 64;
    block_of_.assign(n_chunks_, -1);
    host_of_.assign(n_chunks_, -1);
    n_written_.assign(n_chunks_, 0);
    dirty_.assign(n_chunks_, 0);
    last_use_.assign(n_chunks_, 0);
    score_.assign(n_chunks_, kUnscored);
    written_.assign(size_t(n_chunks_) * words_, 0);
    chunk_of_.assign(n_blocks_, -1);
    slot_pos_.assign(size_t(cfg_.pool_tokens), -1);
    for (int32_t b = n_blocks_ - 1; b >= 0; --b) free_blocks_.push_back(b);
}

bool Pager::protected_under(int32_t c, int64_t head) const {
    if (c < cfg_.sink_chunks) return true;
    return head >= 0 && c <= head && c >= head - cfg_.tail_window_chunks;
}

bool Pager::is_protected(int32_t c) const { return protected_under(c, head_); }

void Pager::validate_chunk(int32_t c, const char *what) const {
    if (c < 0 || c >= n_chunks_)
        throw std::out_of_range(std::string(what) + ": chunk " + std::to_string(c) + " outside [0, " +
                                std::to_string(n_chunks_) + ")");
}

int32_t Pager::pick_victim(int64_t head, int32_t lo, int32_t hi) const {
    int32_t best = -1;
    for (int32_t b = 0; b < n_blocks_; ++b) {
        const int32_t c = chunk_of_[b];
        if (c < 0 || (c >= lo && c <= hi) || protected_under(c, head)) continue;
        if (best < 0) { best = c; continue; }
        if (has_scores_ && score_[c] != score_[best]) {
            if (score_[c] < score_[best]) best = c;
        } else if (last_use_[c] < last_use_[best]) {
            best = c;
        }
    }
    return best;
}

void Pager::do_evict(int32_t c) {
    // precondition: c resident
    const int32_t b = block_of_[c];
    assert(b >= 0 && chunk_of_[b] == c);
    if (host_of_[c] < 0) host_of_[c] = host_->acquire();
    if (dirty_[c]) {
        mover_->page_out(b, host_->ptr(host_of_[c]));
        stats_.page_outs++;
        stats_.bytes_out += int64_t(mover_->chunk_bytes());
        dirty_[c] = 0;
    } else {
        stats_.clean_skips++;
    }
    std::fill(slot_pos_.begin() + int64_t(b) * cfg_.chunk_tokens,
              slot_pos_.begin() + int64_t(b + 1) * cfg_.chunk_tokens, -1);
    chunk_of_[b] = -1;
    block_of_[c] = -1;
    free_blocks_.push_back(b);
    stats_.epoch++;
}

void Pager::mark_dirty(int32_t c) {
    if (c < 0 || c >= n_chunks_ || block_of_[c] < 0)
        throw std::invalid_argument("mark_dirty: chunk " + std::to_string(c) + " is not resident");
    dirty_[c] = 1;
}

void Pager::do_place(int32_t c, int32_t b) {
    // precondition: c not resident, b free
    assert(block_of_[c] < 0 && chunk_of_[b] < 0);
    chunk_of_[b] = c;
    block_of_[c] = b;
    if (host_of_[c] >= 0) {
        mover_->page_in(b, host_->ptr(host_of_[c]));
        stats_.page_ins++;
        stats_.bytes_in += int64_t(mover_->chunk_bytes());
        dirty_[c] = 0;
    } else {
        dirty_[c] = 1;
    }
    const int64_t base = int64_t(b) * cfg_.chunk_tokens, pos0 = int64_t(c) * cfg_.chunk_tokens;
    for (int32_t i = 0; i < cfg_.chunk_tokens; ++i) slot_pos_[base + i] = written(c, i) ? pos0 + i : -1;
    last_use_[c] = ++tick_;
    stats_.epoch++;
}

int32_t Pager::take_block(int64_t head, int32_t lo, int32_t hi) {
    if (free_blocks_.empty()) {
        const int32_t v = pick_victim(head, lo, hi);
        if (v < 0) return -1;
        do_evict(v);
    }
    const int32_t b = free_blocks_.back();
    free_blocks_.pop_back();
    return b;
}

AllocResult Pager::alloc_span(int64_t pos0, int32_t n, int32_t *slots_out) {
    if (n <= 0) throw std::invalid_argument("alloc_span: n must be > 0, got " + std::to_string(n));
    check_span(pos0, n, cfg_.max_ctx, "alloc_span");
    const int32_t C = cfg_.chunk_tokens;
    const int32_t c0 = int32_t(pos0 / C), c1 = int32_t((pos0 + n - 1) / C);
    const int64_t new_head = std::max<int64_t>(head_, c1);

    // Plan: count the blocks needed and the blocks obtainable; change nothing on failure.
    int32_t need = 0;
    for (int32_t c = c0; c <= c1; ++c) need += block_of_[c] < 0;
    if (need > 0) {
        int32_t avail = int32_t(free_blocks_.size());
        for (int32_t b = 0; b < n_blocks_ && avail < need; ++b) {
            const int32_t c = chunk_of_[b];
            if (c >= 0 && (c < c0 || c > c1) && !protected_under(c, new_head)) ++avail;
        }
        if (avail < need) return AllocResult::NO_ROOM;
        // The evictions below need host buffers: get them now, so a store that cannot grow
        // (memory, disk, max_host_bytes) throws before anything changed.
        // The victims are the first `evictions` candidates in pick_victim's order (score
        // when scored, then last use, then block), so exactly their missing copies count.
        const int32_t evictions = need - int32_t(free_blocks_.size());
        if (evictions > 0) {
            std::vector<int32_t> cand;
            for (int32_t b = 0; b < n_blocks_; ++b) {
                const int32_t c = chunk_of_[b];
                if (c >= 0 && (c < c0 || c > c1) && !protected_under(c, new_head)) cand.push_back(c);
            }
            std::stable_sort(cand.begin(), cand.end(), [&](int32_t a, int32_t b) {
                if (has_scores_ && score_[a] != score_[b]) return score_[a] < score_[b];
                return last_use_[a] < last_use_[b];
            });
            int32_t copies = 0;
            for (int32_t k = 0; k < evictions && k < int32_t(cand.size()); ++k) copies += host_of_[cand[k]] < 0;
            host_->reserve(copies);
        }
    }

    // Commit.
    for (int32_t c = c0; c <= c1; ++c) {
        if (block_of_[c] >= 0) continue;
        const int32_t b = take_block(new_head, c0, c1);
        assert(b >= 0);
        do_place(c, b);
    }
    int32_t last_c = -1;
    for (int32_t k = 0; k < n; ++k) {
        const int64_t p = pos0 + k;
        const int32_t c = int32_t(p / C), i = int32_t(p % C);
        uint64_t &w = written_[size_t(c) * words_ + i / 64];
        if (!((w >> (i % 64)) & 1)) {
            w |= uint64_t(1) << (i % 64);
            if (n_written_[c]++ == 0) score_[c] = kUnscored;
        }
        const int32_t slot = block_of_[c] * C + i;
        slot_pos_[slot] = p;
        if (slots_out) slots_out[k] = slot;
        if (c != last_c) {
            dirty_[c] = 1;
            last_use_[c] = ++tick_;
            last_c = c;
        }
    }
    head_ = new_head;
    return AllocResult::OK;
}

int32_t Pager::slot_of(int64_t pos) const {
    if (pos < 0 || pos >= cfg_.max_ctx) return -1;
    const int32_t c = int32_t(pos / cfg_.chunk_tokens), i = int32_t(pos % cfg_.chunk_tokens);
    if (block_of_[c] < 0 || !written(c, i)) return -1;
    return block_of_[c] * cfg_.chunk_tokens + i;
}

void Pager::evict(int32_t c) {
    validate_chunk(c, "evict");
    if (block_of_[c] < 0) throw std::invalid_argument("evict: chunk " + std::to_string(c) + " is not resident");
    if (is_protected(c))
        throw std::invalid_argument("evict: chunk " + std::to_string(c) + " is protected (sink or tail window)");
    do_evict(c);
}

AllocResult Pager::recall(int32_t c) {
    validate_chunk(c, "recall");
    if (block_of_[c] >= 0) throw std::invalid_argument("recall: chunk " + std::to_string(c) + " is already resident");
    if (host_of_[c] < 0 || n_written_[c] == 0)
        throw std::invalid_argument("recall: chunk " + std::to_string(c) + " is not on the host");
    if (free_blocks_.empty() && pick_victim(head_, c, c) < 0) return AllocResult::NO_ROOM;
    const int32_t b = take_block(head_, c, c);
    do_place(c, b);
    return AllocResult::OK;
}

void Pager::set_scores(const float *scores, int32_t n) {
    if (n < 0 || n > n_chunks_)
        throw std::invalid_argument("scores: expected at most " + std::to_string(n_chunks_) + " entries, got " +
                                    std::to_string(n));
    for (int32_t c = 0; c < n; ++c)
        if (std::isnan(scores[c])) throw std::invalid_argument("scores: NaN at chunk " + std::to_string(c));
    for (int32_t c = 0; c < n_chunks_; ++c) score_[c] = c < n ? scores[c] : kUnscored;
    has_scores_ = true;
}

void Pager::clear_scores() {
    std::fill(score_.begin(), score_.end(), kUnscored);
    has_scores_ = false;
}

int32_t Pager::reselect(const float *scores, int32_t n) {
    const std::vector<float> old_scores = score_;
    const bool had_scores = has_scores_;
    set_scores(scores, n);
    std::vector<int32_t> prot, rest;
    for (int32_t c = 0; c <= head_; ++c) {
        if (n_written_[c] == 0) continue;
        (is_protected(c) ? prot : rest).push_back(c);
    }
    const int32_t keep = std::max<int32_t>(0, n_blocks_ - int32_t(prot.size()));
    if (int32_t(rest.size()) > keep) {
        // Highest score first; on ties prefer what is already resident, then recency.
        std::partial_sort(rest.begin(), rest.begin() + keep, rest.end(), [&](int32_t a, int32_t b) {
            if (score_[a] != score_[b]) return score_[a] > score_[b];
            const bool ra = block_of_[a] >= 0, rb = block_of_[b] >= 0;
            if (ra != rb) return ra;
            return last_use_[a] > last_use_[b];
        });
    }
    const int32_t n_keep = std::min<int32_t>(keep, int32_t(rest.size()));
    std::vector<uint8_t> target(n_chunks_, 0);
    for (int32_t c : prot) target[c] = 1;
    for (int32_t k = 0; k < n_keep; ++k) target[rest[k]] = 1;
    int32_t moved = 0, copies = 0;
    for (int32_t b = 0; b < n_blocks_; ++b) {
        const int32_t c = chunk_of_[b];
        copies += c >= 0 && !target[c] && host_of_[c] < 0;
    }
    try {
        host_->reserve(copies);  // all or nothing: a store that cannot grow throws before any move
    } catch (...) {
        score_ = old_scores;
        has_scores_ = had_scores;
        throw;
    }
    for (int32_t b = 0; b < n_blocks_; ++b) {
        const int32_t c = chunk_of_[b];
        if (c >= 0 && !target[c]) { do_evict(c); ++moved; }
    }
    for (int32_t k = 0; k < n_keep; ++k) {
        const int32_t c = rest[k];
        if (block_of_[c] >= 0) continue;
        assert(!free_blocks_.empty());
        const int32_t b = free_blocks_.back();
        free_blocks_.pop_back();
        do_place(c, b);
        ++moved;
    }
    return moved;
}

void Pager::truncate(int64_t n_past) {
    if (n_past < 0 || n_past > cfg_.max_ctx)
        throw std::out_of_range("truncate: n_past " + std::to_string(n_past) + " outside [0, max_ctx=" +
                                std::to_string(cfg_.max_ctx) + "]");
    const int32_t C = cfg_.chunk_tokens;
    // Last chunk first: its block goes on the free list first, so the lowest freed block is taken
    // next and a full cache (pool = context) keeps block = chunk through truncations -- its
    // attention then walks the rows in position order every time, whatever ran before.
    for (int64_t c = head_; c >= n_past / C; --c) {
        for (int32_t i = 0; i < C; ++i) {
            if (int64_t(c) * C + i < n_past || !written(int32_t(c), i)) continue;
            written_[size_t(c) * words_ + i / 64] &= ~(uint64_t(1) << (i % 64));
            n_written_[c]--;
            if (block_of_[c] >= 0) slot_pos_[int64_t(block_of_[c]) * C + i] = -1;
        }
        if (n_written_[c] == 0) {
            if (block_of_[c] >= 0) {
                const int32_t b = block_of_[c];
                chunk_of_[b] = -1;
                block_of_[c] = -1;
                free_blocks_.push_back(b);
            }
            if (host_of_[c] >= 0) { host_->release(host_of_[c]); host_of_[c] = -1; }
            dirty_[c] = 0;
            score_[c] = kUnscored;
        }
    }
    // The new head is the last chunk still holding a position (there may be gaps).
    int64_t h = n_past > 0 ? std::min<int64_t>((n_past - 1) / C, head_) : -1;
    while (h >= 0 && n_written_[h] == 0) --h;
    head_ = h;
    // The new tail window may hold chunks that were paged out: bring them back.
    for (int64_t c = std::max<int64_t>(0, head_ - cfg_.tail_window_chunks); c <= head_; ++c) {
        if (n_written_[c] > 0 && block_of_[c] < 0) {
            const int32_t b = take_block(head_, int32_t(c), int32_t(c));
            assert(b >= 0);
            do_place(int32_t(c), b);
        }
    }
    stats_.epoch++;
}

void Pager::reset() {
    std::fill(block_of_.begin(), block_of_.end(), -1);
    std::fill(host_of_.begin(), host_of_.end(), -1);
    std::fill(n_written_.begin(), n_written_.end(), 0);
    std::fill(dirty_.begin(), dirty_.end(), 0);
    std::fill(last_use_.begin(), last_use_.end(), 0);
    std::fill(written_.begin(), written_.end(), 0);
    std::fill(chunk_of_.begin(), chunk_of_.end(), -1);
    std::fill(slot_pos_.begin(), slot_pos_.end(), -1);
    free_blocks_.clear();
    for (int32_t b = n_blocks_ - 1; b >= 0; --b) free_blocks_.push_back(b);
    mover_->fence();          // no queued copy may still read or write a host buffer
    host_->release_memory();  // a new conversation starts with no host memory held
    clear_scores();
    head_ = -1;
    tick_ = 0;
    const int64_t epoch = stats_.epoch;
    stats_ = PagerStats{};
    stats_.epoch = epoch + 1;  // monotonic, so cached masks never match a new session
}

void Pager::fill_mask(const int64_t *q_pos, int32_t n_q, uint16_t *out, int32_t n_kv, int32_t window) const {
    if (n_kv < used_extent())
        throw std::invalid_argument("fill_mask: n_kv " + std::to_string(n_kv) + " cuts off occupied slots (extent " +
                                    std::to_string(used_extent()) + ")");
    const int64_t P = std::min<int64_t>(cfg_.pool_tokens, n_kv);
    for (int32_t q = 0; q < n_q; ++q) {
        uint16_t *row = out + int64_t(q) * n_kv;
        const int64_t qp = q_pos[q];
        const int64_t lo = window > 0 ? qp - window : std::numeric_limits<int64_t>::min();
        for (int64_t s = 0; s < P; ++s) {
            const int64_t p = slot_pos_[s];
            row[s] = (p >= 0 && p <= qp && p > lo) ? kF16Zero : kF16NegInf;
        }
        std::fill(row + P, row + n_kv, kF16NegInf);
    }
}

int32_t Pager::used_extent() const {
    for (int32_t b = n_blocks_ - 1; b >= 0; --b)
        if (chunk_of_[b] >= 0) return (b + 1) * cfg_.chunk_tokens;
    return 0;
}

PagerStats Pager::stats() const {
    PagerStats s = stats_;
    s.n_blocks = n_blocks_;
    s.free_blocks = int32_t(free_blocks_.size());
    for (int32_t c = 0; c < n_chunks_; ++c) {
        s.resident_chunks += block_of_[c] >= 0;
        s.host_chunks += (block_of_[c] < 0 && host_of_[c] >= 0);
        s.materialised_chunks += n_written_[c] > 0;
    }
    s.resident_bytes = size_t(n_blocks_) * mover_->chunk_bytes();
    s.host_bytes = size_t(host_->in_use()) * mover_->chunk_bytes();
    s.host_reserved_bytes = host_->reserved_bytes();
    return s;
}

void Pager::check_invariants() const {
    auto fail = [](const std::string &m) { throw std::logic_error("pager invariant: " + m); };
    const int32_t C = cfg_.chunk_tokens;
    std::vector<uint8_t> is_free(n_blocks_, 0);
    for (int32_t b : free_blocks_) {
        if (b < 0 || b >= n_blocks_) fail("free list holds bad block " + std::to_string(b));
        if (is_free[b]) fail("block " + std::to_string(b) + " twice on the free list");
        is_free[b] = 1;
    }
    for (int32_t b = 0; b < n_blocks_; ++b) {
        const int32_t c = chunk_of_[b];
        if ((c < 0) != bool(is_free[b])) fail("block " + std::to_string(b) + " free-list membership disagrees with its owner");
        if (c >= 0 && block_of_[c] != b) fail("block " + std::to_string(b) + " -> chunk " + std::to_string(c) + " but chunk -> " + std::to_string(block_of_[c]));
        for (int32_t i = 0; i < C; ++i) {
            const int64_t want = (c >= 0 && written(c, i)) ? int64_t(c) * C + i : -1;
            if (slot_pos_[int64_t(b) * C + i] != want)
                fail("slot " + std::to_string(b * C + i) + " maps position " + std::to_string(slot_pos_[b * C + i]) +
                     ", expected " + std::to_string(want));
        }
    }
    int32_t on_host = 0;
    int64_t max_mat = -1;
    for (int32_t c = 0; c < n_chunks_; ++c) {
        int32_t pc = 0;
        for (int32_t w = 0; w < words_; ++w) pc += __builtin_popcountll(written_[size_t(c) * words_ + w]);
        if (pc != n_written_[c]) fail("chunk " + std::to_string(c) + " written count disagrees with its bitmap");
        const int32_t b = block_of_[c];
        if (b >= 0 && chunk_of_[b] != c) fail("chunk " + std::to_string(c) + " -> block " + std::to_string(b) + " not reciprocated");
        if (host_of_[c] >= 0) {
            ++on_host;
            if (!host_->is_acquired(host_of_[c])) fail("chunk " + std::to_string(c) + " host buffer not acquired");
        }
        if (n_written_[c] == 0) {
            if (b >= 0 || host_of_[c] >= 0) fail("empty chunk " + std::to_string(c) + " holds a block or host buffer");
            continue;
        }
        max_mat = c;
        if (b < 0 && host_of_[c] < 0) fail("chunk " + std::to_string(c) + " is neither resident nor on the host");
        if (b >= 0 && !dirty_[c] && host_of_[c] < 0) fail("clean chunk " + std::to_string(c) + " has no host copy");
        if (is_protected(c) && b < 0) fail("protected chunk " + std::to_string(c) + " is not resident");
    }
    if (max_mat != head_ && !(max_mat < 0 && head_ < 0))
        fail("head chunk " + std::to_string(head_) + " but last materialised is " + std::to_string(max_mat));
    if (on_host != host_->in_use()) fail("host buffers in use disagree with the chunk table");
}

std::string Pager::dump() const {
    std::ostringstream os;
    const int64_t last = std::max<int64_t>(head_, -1);
    for (int32_t c = 0; c <= last; ++c) {
        char ch = '.';
        if (n_written_[c] > 0) {
            if (block_of_[c] >= 0) ch = c < cfg_.sink_chunks ? 'S' : (is_protected(c) ? 'T' : 'R');
            else ch = 'H';
        }
        os << ch;
        if ((c + 1) % 64 == 0) os << '\n';
    }
    const PagerStats s = stats();
    os << "\nblocks " << s.n_blocks << " (free " << s.free_blocks << "), resident " << s.resident_chunks
       << ", host " << s.host_chunks << ", head " << head_ << ", epoch " << s.epoch << ", outs " << s.page_outs
       << ", ins " << s.page_ins << ", clean skips " << s.clean_skips << "\n";
    return os.str();
}

}  // namespace kvflash
