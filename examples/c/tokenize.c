/* Tokenize from C with kvflash's tokenizer (llama.cpp's, through kvflash.h).
 *
 *   kvflash_tokenize VOCAB.gguf TEXT_FILE [--cases] [--special]
 *
 * Prints the ids of TEXT_FILE's contents on one line.  --cases: the file holds several texts
 * separated by "\n__ggml_vocab_test__\n" (llama.cpp's ggml-vocab-*.gguf.inp files); one line of ids
 * per text, as the .gguf.out files hold them, and each text is checked to decode back to itself.
 * --special: add BOS/EOS as the vocabulary asks and parse special tokens written in the text
 * (without it: neither, as llama.cpp's test-tokenizer-0 tokenizes). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvflash.h"

static const char SEP[] = "\n__ggml_vocab_test__\n";

static char *read_file(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    char *buf;
    long n;
    if (!f) return NULL;
    if (fseek(f, 0, SEEK_END) != 0 || (n = ftell(f)) < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return NULL;
    }
    buf = malloc((size_t)n + 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf) buf[n] = '\0';
    *len = (size_t)n;
    return buf;
}

/* ids of text[0 .. len) on one line; returns 0, or 1 after printing why to stderr. */
static int tokenize_one(const kvflash_vocab *v, const char *text, size_t len, int special, int check_roundtrip) {
    int32_t n = 0, n_text = 0, i;
    int32_t *ids;
    char *back;
    /* ask the size first (KVFLASH_ESIZE), then tokenize into a buffer that fits */
    int rc = kvflash_tokenize(v, text, len, NULL, 0, special, special, &n);
    if (rc != KVFLASH_OK && rc != KVFLASH_ESIZE) {
        fprintf(stderr, "tokenize: %d %s\n", rc, kvflash_vocab_last_error());
        return 1;
    }
    ids = malloc(sizeof(int32_t) * (size_t)(n > 0 ? n : 1));
    if (!ids || kvflash_tokenize(v, text, len, ids, n, special, special, &n) != KVFLASH_OK) {
        fprintf(stderr, "tokenize: %s\n", kvflash_vocab_last_error());
        free(ids);
        return 1;
    }
    for (i = 0; i < n; ++i) printf(" %d", ids[i]);
    printf("\n");
    if (check_roundtrip) {
        /* the pieces joined give the text back (after the one space a SentencePiece vocabulary puts
         * first); kvflash_detokenize would too, but it also cleans spaces as llama.cpp does for some
         * vocabularies (" 's" -> "'s") */
        char piece[512];
        size_t at = 0;
        int32_t np = 0;
        back = malloc((size_t)n * sizeof piece + 1);  /* every piece fits piece[] */
        for (i = 0; back && i < n; ++i) {
            if (kvflash_token_to_piece(v, ids[i], piece, (int32_t)sizeof piece, 0, &np) != KVFLASH_OK) {
                fprintf(stderr, "token_to_piece %d: %s\n", ids[i], kvflash_vocab_last_error());
                free(back);
                free(ids);
                return 1;
            }
            memcpy(back + at, piece, (size_t)np);
            at += (size_t)np;
        }
        n_text = (int32_t)at;
        if (!back || !((at == len && memcmp(back, text, len) == 0) ||
                       (at == len + 1 && back[0] == ' ' && memcmp(back + 1, text, len) == 0))) {
            fprintf(stderr, "roundtrip: %.*s came back as %.*s\n", (int)len, text, (int)n_text, back ? back : "");
            free(back);
            free(ids);
            return 1;
        }
        free(back);
    }
    free(ids);
    return 0;
}

int main(int argc, char **argv) {
    char err[512];
    int cases = 0, special = 0, i, failed = 0;
    size_t len = 0;
    char *text, *p, *end;
    kvflash_vocab *v;
    if (argc < 3) {
        fprintf(stderr, "usage: %s VOCAB.gguf TEXT_FILE [--cases] [--special]\n", argv[0]);
        return 2;
    }
    for (i = 3; i < argc; ++i) {
        if (strcmp(argv[i], "--cases") == 0) cases = 1;
        else if (strcmp(argv[i], "--special") == 0) special = 1;
        else {
            fprintf(stderr, "unknown option %s\n", argv[i]);
            return 2;
        }
    }
    v = kvflash_vocab_load(argv[1], err, sizeof err);
    if (!v) {
        fprintf(stderr, "load: %s\n", err);
        return 1;
    }
    text = read_file(argv[2], &len);
    if (!text) {
        fprintf(stderr, "cannot read %s\n", argv[2]);
        kvflash_vocab_free(v);
        return 1;
    }
    fprintf(stderr, "vocab: %d tokens, bos %d, eos %d, add_bos %d\n", kvflash_vocab_n_tokens(v), kvflash_vocab_bos(v),
            kvflash_vocab_eos(v), kvflash_vocab_add_bos(v));
    if (!cases) {
        failed = tokenize_one(v, text, len, special, 0);
    } else {
        p = text;
        end = text + len;
        for (;;) {
            char *next = strstr(p, SEP);
            size_t n = next ? (size_t)(next - p) : (size_t)(end - p);
            failed |= tokenize_one(v, p, n, special, !special);
            if (!next) break;
            p = next + strlen(SEP);
            if (p == end) break;  /* a trailing separator ends the list */
        }
    }
    free(text);
    kvflash_vocab_free(v);
    return failed;
}
