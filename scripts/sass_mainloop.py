"""Instructions per K block of every FP8 GEMM mainloop (fp8g::mainloop) in a cubin's SASS.

  python scripts/sass_mainloop.py [-v] [file.cubin | file.sass ...]
  (default: the forward and backward FP8 cubins in mok_rt/cubins; a .cubin goes through nvdisasm -c)

A mainloop is found as the batches of QGMMAs (each up to the one that sets gsb0) inside one loop,
two (sub-tiles 0 and 1) or one (a copy for one sub-tile), and their WARPGROUP.DEPBARs.  Counted on the common path (the stage ready at the first try_wait, the rows not
idle, two sub-tiles), as shortest paths through the control-flow graph with BRA.DIV not diverging:
  c1   after sub-tile 0's DEPBAR up to sub-tile 1's first QGMMA (the t0 promotion, descriptors)
  c2   after sub-tile 1's (the last) DEPBAR, round the loop (through the t1 promotion's 64th FFMA and the
       stage wait's first try_wait) up to the next K block's first QGMMA
  mma  the batches, each from its first QGMMA to its DEPBAR (what issues under the MMAs)
c1 and c2 are a warpgroup's turnaround between its MMA batches (docs/FP8_DESIGN.md, "Mainloop
turnaround"); -v breaks them down by opcode."""
import collections, heapq, os, re, subprocess, sys

INS = re.compile(r'/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;')
LABEL = re.compile(r'^(\.L_x_\d+):')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = [os.path.join(ROOT, 'mok_rt', 'cubins', f'{k}.sm_90a.cubin') for k in ('moe_forward_fp8', 'moe_backward_fp8')]


def parse(text):
    rows, labels = [], {}
    for line in text.splitlines():
        m = LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(rows)
            continue
        m = INS.search(line)
        if m:
            rows.append(m.group(2))
    return rows, labels


def op(t):
    return re.sub(r'^@!?U?P\w+\s+', '', t).split()[0]


def successors(rows, labels, i):
    t = rows[i]
    o = op(t)
    if o.startswith('BRA.DIV'):
        return [i + 1]
    if o == 'BRA':
        out = [labels[re.search(r'`\((\.L_x_\d+)\)', t).group(1)]]
        if t.startswith('@') or re.search(r'BRA\s+!?U?P\d', t):
            out.append(i + 1)
        return out
    if o in ('EXIT', 'RET', 'BPT'):
        return []
    return [i + 1]


def path(rows, labels, a, b):
    """Shortest path a -> b, both ends included."""
    dist, prev, heap = {a: 0}, {}, [(0, a)]
    while heap:
        d, u = heapq.heappop(heap)
        if u == b:
            break
        if d > dist[u]:
            continue
        for v in successors(rows, labels, u):
            if v not in dist or d + 1 < dist[v]:
                dist[v], prev[v] = d + 1, u
                heapq.heappush(heap, (d + 1, v))
    out = [b]
    while out[-1] != a:
        out.append(prev[out[-1]])
    return out[::-1]


def count(rows, idx):
    c = collections.Counter(op(rows[j]).split('.')[0] for j in idx)
    return ' '.join(f'{k}:{v}' for k, v in c.most_common())


def report(name, text, verbose):
    rows, labels = parse(text)
    batches = []
    for i, r in enumerate(rows):
        if op(r).startswith('QGMMA'):
            if batches and 'gsb0' not in rows[batches[-1][-1]]:
                batches[-1].append(i)
            else:
                batches.append([i])
    def loop_of(b):  # the innermost loop around batch b: its back branch
        for j in range(b[-1], len(rows)):
            m = re.search(r'`\((\.L_x_\d+)\)', rows[j])
            if m and op(rows[j]) == 'BRA' and labels[m.group(1)] < b[0]:
                return j
    loops = collections.defaultdict(list)
    for b in batches:
        loops[loop_of(b)].append(b)
    print(f'{name}: {len(rows)} instructions, {len(loops)} FP8 mainloops')
    depbar = lambda b: next(j for j in range(b[-1], len(rows)) if op(rows[j]).startswith('WARPGROUP.DEPBAR'))
    for n, bs in enumerate(loops.values()):
        b1, b2 = bs[0], bs[-1]  # one batch: a loop for one sub-tile, c1 empty
        d1, d2 = depbar(b1), depbar(b2)
        c1 = path(rows, labels, d1, b2[0])[1:-1] if len(bs) == 2 else []
        ffma = [j for j in range(d2, len(rows)) if op(rows[j]) == 'FFMA'][63]
        wait = [j for j in range(b1[0]) if 'TRYWAIT' in rows[j]][-2]
        c2 = (path(rows, labels, d2, ffma)[1:-1] + path(rows, labels, ffma, wait)[:-1] +
              path(rows, labels, wait, b1[0])[:-1])
        mma = sorted(set(j for b in bs for j in range(b[0], depbar(b) + 1)))
        total = len(c1) + len(c2) + len(mma)
        kind = 'two sub-tiles' if len(bs) == 2 else 'one sub-tile'
        print(f'  mainloop {n + 1} ({kind}): per K block {total}: c1 {len(c1)}, c2 {len(c2)}, mma {len(mma)}')
        if verbose:
            print(f'    c1: {count(rows, c1)}\n    c2: {count(rows, c2)}\n    mma: {count(rows, mma)}')


def main(argv):
    verbose = '-v' in argv
    files = [a for a in argv if a != '-v'] or DEFAULT
    for f in files:
        text = subprocess.run(['nvdisasm', '-c', f], check=True, capture_output=True, text=True).stdout \
            if f.endswith('.cubin') else open(f).read()
        report(os.path.basename(f), text, verbose)


if __name__ == '__main__':
    main(sys.argv[1:])
