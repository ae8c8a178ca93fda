"""Digest of ncu's per-instruction SASS page (scripts/gpu_calibrate.sh ncu_src -> ncu_src.csv): per
kernel, stall reasons over all samples, executed instructions and samples by opcode, and the 25
instructions with the most samples.    python bench/experiments/ncu_source_digest.py [ncu_src.csv]"""
import csv, sys, collections
rows=list(csv.reader(open(sys.argv[1] if len(sys.argv) > 1 else 'ncu_src.csv')))
kernels=[]; cur=None
for r in rows:
    if r and r[0]=='Kernel Name': cur={'name':r[1],'ins':[]}; kernels.append(cur); continue
    if r and r[0]=='Address': cur['hdr']=r; continue
    if cur and r and r[0].startswith('0x'): cur['ins'].append(r)
for k in kernels:
    h=k['hdr']; ix={n:i for i,n in enumerate(h)}
    ins=k['ins']; tot=sum(int(r[2]) for r in ins)
    print('=====',k['name'][:60],'instructions',len(ins),'samples',tot)
    # stall totals
    st=collections.Counter()
    for r in ins:
        for n,i in ix.items():
            if n.startswith('stall_') and 'Not Issued' not in n: st[n]+=int(r[i] or 0)
    print('  stalls:',', '.join(f'{n[6:]}={v*100/tot:.1f}%' for n,v in st.most_common(8)))
    # opcode histogram by executed
    op=collections.Counter(); ops=collections.Counter()
    for r in ins:
        src=r[1].strip(); 
        o=src.split()[0] if not src.startswith('@') else src.split()[1]
        o=o.split('.')[0]
        op[o]+=int(r[ix['Instructions Executed']] or 0); ops[o]+=int(r[2])
    te=sum(op.values())
    print('  executed by op:',', '.join(f'{o}={v*100/te:.1f}%' for o,v in op.most_common(12)), 'total',te)
    print('  samples by op:',', '.join(f'{o}={v*100/tot:.1f}%' for o,v in ops.most_common(12)))
    top=sorted(ins,key=lambda r:-int(r[2]))[:25]
    for r in top:
        s=[(n[6:],int(r[i])) for n,i in ix.items() if n.startswith('stall_') and 'Not Issued' not in n and int(r[i] or 0)>0]
        s.sort(key=lambda x:-x[1])
        print(f'   {r[0][-5:]} {int(r[2])*100/tot:5.1f}% ex={r[ix["Instructions Executed"]]:>9} {r[1].strip()[:60]:60} {s[:3]}')
