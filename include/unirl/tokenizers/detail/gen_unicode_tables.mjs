// Generates unicode_tables.hpp (next to this file) from the Unicode data of the running Node's ICU:
//   node include/unirl/tokenizers/detail/gen_unicode_tables.mjs
// - general categories the pre-tokenizers need: \p{L} (letters), \p{N} (numbers) and
//   \p{White_Space} (what Oniguruma's and Rust's `\s` match, as used by Hugging Face tokenizers);
// - NFC data: full canonical decompositions (String.prototype.normalize("NFD") per code point),
//   canonical combining classes (derived from how NFD orders pairs of marks, stored as ranks that
//   keep their order and their zero/non-zero-ness, which is all canonical ordering and
//   composition compare) and primary composites (NFC(first + second) == composite).
// The generator re-implements NFC from the tables and checks it against normalize("NFC") on every
// code point and on mark sequences before it writes anything; it exits non-zero on a mismatch.
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const MAX = 0x110000;
const SBase = 0xac00, LBase = 0x1100, VBase = 0x1161, TBase = 0x11a7, LCount = 19, VCount = 21, TCount = 28;
const NCount = VCount * TCount, SCount = LCount * NCount;
const isSurrogate = (c) => c >= 0xd800 && c <= 0xdfff;
const isHangulS = (c) => c >= SBase && c < SBase + SCount;
const str = (...cps) => String.fromCodePoint(...cps);
const cpsOf = (s) => Array.from(s, (ch) => ch.codePointAt(0));

// ---- categories --------------------------------------------------------------------------------
const reL = /\p{L}/u, reN = /\p{N}/u, reWS = /\p{White_Space}/u;
const catRuns = [];  // [start, class]
{
  let prev = -1;
  for (let c = 0; c < MAX; ++c) {
    let k = 0;
    if (!isSurrogate(c)) {
      const s = str(c);
      k = reL.test(s) ? 1 : reN.test(s) ? 2 : reWS.test(s) ? 3 : 0;
    }
    if (k !== prev) { catRuns.push([c, k]); prev = k; }
  }
}

// ---- canonical combining classes ---------------------------------------------------------------
// Only code points that NFD leaves alone matter (decomposable ones are decomposed first).
const nfdSame = (c) => !isSurrogate(c) && str(c).normalize('NFD') === str(c);
const marks = [];
for (let c = 0x80; c < MAX; ++c) {
  if (!nfdSame(c)) continue;
  const x = str(c);
  // 0 < ccc(x) < 240: NFD moves x in front of U+0345 (ccc 240). ccc(x) >= 240: NFD moves U+0334
  // (ccc 1) in front of x.
  const a = ('a\u0345' + x).normalize('NFD') === 'a' + x + '\u0345';
  const b = ('a' + x + '\u0334').normalize('NFD') === 'a\u0334' + x;
  if (a || b || c === 0x345) marks.push(c);
}
const cmp = (x, y) => {
  if (x === y) return 0;
  if (('a' + str(x, y)).normalize('NFD') === 'a' + str(y, x)) return 1;   // ccc(x) > ccc(y)
  if (('a' + str(y, x)).normalize('NFD') === 'a' + str(x, y)) return -1;
  return 0;
};
marks.sort(cmp);
const ccc = new Map();
{
  let rank = 0;
  for (let i = 0; i < marks.length; ++i) {
    if (i === 0 || cmp(marks[i - 1], marks[i]) !== 0) ++rank;
    ccc.set(marks[i], rank);
  }
  if (rank > 255) throw new Error(`too many combining classes: ${rank}`);
}
const cccOf = (c) => ccc.get(c) ?? 0;

// ---- decompositions and compositions -----------------------------------------------------------
const decomp = new Map();  // code point -> full canonical decomposition (Hangul syllables excluded)
for (let c = 0; c < MAX; ++c) {
  if (isSurrogate(c) || isHangulS(c)) continue;
  const d = str(c).normalize('NFD');
  if (d !== str(c)) decomp.set(c, cpsOf(d));
}
const comp = new Map();  // first * 2^21 + second -> composite
for (const [c, d] of decomp) {
  if (str(c).normalize('NFC') !== str(c) || d.length < 2) continue;  // excluded or singleton
  const first = cpsOf(str(...d.slice(0, -1)).normalize('NFC'));
  const second = d[d.length - 1];
  if (first.length !== 1 || str(first[0], second).normalize('NFC') !== str(c))
    throw new Error(`cannot derive the composition pair of U+${c.toString(16)}`);
  comp.set(first[0] * 0x200000 + second, c);
}

// ---- NFC from the tables, checked against ICU --------------------------------------------------
function nfc(cps) {
  const d = [];
  for (const c of cps) {
    if (isHangulS(c)) {
      const s = c - SBase;
      d.push(LBase + Math.floor(s / NCount), VBase + Math.floor((s % NCount) / TCount));
      if (s % TCount) d.push(TBase + (s % TCount));
    } else if (decomp.has(c)) d.push(...decomp.get(c)); else d.push(c);
  }
  for (let i = 1; i < d.length; ++i) {  // canonical ordering (stable insertion sort)
    const k = cccOf(d[i]);
    if (k === 0) continue;
    let j = i;
    while (j > 0 && cccOf(d[j - 1]) > k) { [d[j - 1], d[j]] = [d[j], d[j - 1]]; --j; }
  }
  if (d.length === 0) return d;
  const composeTwo = (a, b) => {
    if (a >= LBase && a < LBase + LCount && b >= VBase && b < VBase + VCount)
      return SBase + ((a - LBase) * VCount + (b - VBase)) * TCount;
    if (isHangulS(a) && (a - SBase) % TCount === 0 && b > TBase && b < TBase + TCount) return a + (b - TBase);
    return comp.get(a * 0x200000 + b);
  };
  let sp = 0, starter = d[0], last = cccOf(starter) ? 256 : 0, out = 1;
  for (let i = 1; i < d.length; ++i) {
    const ch = d[i], k = cccOf(ch);
    const composite = composeTwo(starter, ch);
    if (composite !== undefined && (last < k || last === 0)) { d[sp] = composite; starter = composite; continue; }
    if (k === 0) { sp = out; starter = ch; }
    last = k;
    d[out++] = ch;
  }
  d.length = out;
  return d;
}
let checked = 0;
const check = (cps) => {
  const want = str(...cps).normalize('NFC'), got = str(...nfc(cps));
  if (want !== got) throw new Error(`NFC mismatch on [${cps.map((c) => c.toString(16))}]`);
  ++checked;
};
for (let c = 0; c < MAX; ++c) if (!isSurrogate(c)) check([c]);
const seconds = [...new Set([...comp.keys()].map((k) => k % 0x200000))];
for (const [c, d] of decomp) { check(d); check([...d].reverse()); for (const m of marks.slice(0, 40)) check([c, m]); }
for (const [k] of comp) { const a = Math.floor(k / 0x200000); for (const m of seconds) check([a, m]); }
let seed = 12345;
const rnd = (n) => { seed = (seed * 1103515245 + 12345) % 2147483648; return seed % n; };
const pool = [...marks, ...seconds, ...[...decomp.keys()], 0x61, 0x65, 0x4f, 0x1100, 0x1161, 0x11a8, 0xac00, 0x3099];
for (let t = 0; t < 200000; ++t) {
  const n = 1 + rnd(6), cps = [];
  for (let i = 0; i < n; ++i) cps.push(pool[rnd(pool.length)]);
  check(cps);
}

// ---- NFC quick check: code points in whose presence a text may change under NFC -----------------
// (a non-zero combining class, a decomposition, or the second half of a composition; Hangul
// jamo V/T included through the algorithmic composition).
const maybe = new Set([...ccc.keys(), ...decomp.keys(), ...seconds]);
for (let c = VBase; c < VBase + VCount; ++c) maybe.add(c);
for (let c = TBase + 1; c < TBase + TCount; ++c) maybe.add(c);
const qcRuns = [];
{
  let prev = -1;
  for (let c = 0; c < MAX; ++c) {
    const k = maybe.has(c) ? 1 : 0;
    if (k !== prev) { qcRuns.push([c, k]); prev = k; }
  }
}
const cccRuns = [];
{
  let prev = -1;
  for (let c = 0; c < MAX; ++c) {
    const k = cccOf(c);
    if (k !== prev) { cccRuns.push([c, k]); prev = k; }
  }
}

// ---- write -------------------------------------------------------------------------------------
const hex = (v) => '0x' + v.toString(16);
const wrap = (items, per = 10) => {
  const lines = [];
  for (let i = 0; i < items.length; i += per) lines.push('    ' + items.slice(i, i + per).join(', ') + ',');
  return lines.join('\n');
};
const decompKeys = [...decomp.keys()].sort((a, b) => a - b);
const decompOff = [], decompData = [];
for (const c of decompKeys) { decompOff.push(decompData.length); decompData.push(...decomp.get(c)); }
decompOff.push(decompData.length);
const compKeys = [...comp.keys()].sort((a, b) => a - b);
const out = `#pragma once
/// \\file unicode_tables.hpp
/// GENERATED by gen_unicode_tables.mjs (next to this file) from Node ${process.version}'s ICU
/// ${process.versions.icu}, Unicode ${process.versions.unicode}. Do not edit; re-run the generator.
/// ${checked} NFC checks of the tables against ICU passed when this file was written.
#include <cstdint>

namespace unirl::tokenizers::detail::ucd {

inline constexpr const char* unicode_version = "${process.versions.unicode}";

/// General-category classes: run starts packed as (first_code_point << 2) | class, where class is
/// 0 other, 1 letter (\\p{L}), 2 number (\\p{N}), 3 white space (\\p{White_Space}).
inline constexpr std::uint32_t category_runs[] = {
${wrap(catRuns.map(([c, k]) => hex(c * 4 + k)))}
};

/// Canonical combining classes as order-preserving ranks (0 = starter): runs packed as
/// (first_code_point << 8) | rank.
inline constexpr std::uint32_t ccc_runs[] = {
${wrap(cccRuns.map(([c, k]) => hex(c * 256 + k)))}
};

/// NFC quick check: runs packed as (first_code_point << 1) | maybe; a text with no "maybe" code
/// point is unchanged by NFC.
inline constexpr std::uint32_t nfc_maybe_runs[] = {
${wrap(qcRuns.map(([c, k]) => hex(c * 2 + k)))}
};

/// Full canonical decompositions (Hangul syllables are algorithmic): code point i decomposes to
/// decomp_data[decomp_offset[i] .. decomp_offset[i + 1]).
inline constexpr std::uint32_t decomp_code_points[] = {
${wrap(decompKeys.map(hex))}
};
inline constexpr std::uint16_t decomp_offset[] = {
${wrap(decompOff.map(String), 16)}
};
inline constexpr std::uint32_t decomp_data[] = {
${wrap(decompData.map(hex))}
};

/// Primary composites: key (first << 21) | second, sorted, and the composite of each key.
inline constexpr std::uint64_t comp_keys[] = {
${wrap(compKeys.map((k) => hex(k) + 'ull'), 8)}
};
inline constexpr std::uint32_t comp_values[] = {
${wrap(compKeys.map((k) => hex(comp.get(k))))}
};

}  // namespace unirl::tokenizers::detail::ucd
`;
const here = path.dirname(fileURLToPath(import.meta.url));
fs.writeFileSync(path.join(here, 'unicode_tables.hpp'), out);
console.log(`categories ${catRuns.length} runs, ccc ${cccRuns.length} runs (${marks.length} marks), ` +
            `decompositions ${decompKeys.length}, compositions ${compKeys.length}, NFC checks ${checked}`);
