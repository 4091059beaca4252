# Splits the prefills that came to an engine holding less of their prompt than another
# (a PDX_EXP_DUMP file of switches.diff: a line a prefill, "replay engine tokens" then each
# engine's "wait_ms compute_ms cached_tokens" by the simulators' true state) by whether they
# were misplaced too and which engine was the best: the holder, the one chosen, or a third.
# Usage: python3 left.py DUMP [tie_ms]
import sys, collections
tie=None
rows=[]
for line in open(sys.argv[1]):
    v=line.split()
    wid,at,tok=int(v[0]),int(v[1]),int(v[2])
    es=[(float(v[3+3*i]),float(v[4+3*i]),int(v[5+3*i])) for i in range((len(v)-3)//3)]
    rows.append((wid,at,tok,es))
tie=float(sys.argv[2]) if len(sys.argv)>2 else 12.8
for grp,name in ((lambda w: w<=3,'70%'),(lambda w: w>3,'85%')):
    R=[r for r in rows if grp(r[0])]
    if not R: continue
    n=len(R); tokens=sum(r[2] for r in R)
    c=collections.Counter(); lost=collections.Counter()
    waits=collections.defaultdict(list)
    for wid,at,tok,es in R:
        ttft=[w+cp for w,cp,_ in es]; best=min(range(len(es)),key=lambda i:ttft[i])
        most=max(e[2] for e in es); holder=max(range(len(es)),key=lambda i:es[i][2])
        left=es[at][2]<most; mis=ttft[at]-ttft[best]>tie
        if not left: continue
        kind=('mis' if mis else 'ok')+('-holderbest' if best==holder else ('-chosenbest' if best==at else '-third'))
        c[kind]+=1; lost[kind]+=most-es[at][2]
        waits[kind].append((es[holder][0],es[at][0],es[holder][1],es[at][1],most-es[at][2],tok))
    print(name,'prefills',n,'tokens',tokens)
    for k in sorted(c):
        ws=waits[k]
        import statistics as st
        print(f"  {k:18} {c[k]:4} ({100*c[k]/n:.2f}%) lost {100*lost[k]/tokens:.2f} pts; holder wait {st.mean(w[0] for w in ws):.0f} chosen wait {st.mean(w[1] for w in ws):.0f}; holder compute {st.mean(w[2] for w in ws):.0f} chosen {st.mean(w[3] for w in ws):.0f}; left tok {st.mean(w[4] for w in ws):.0f} of {st.mean(w[5] for w in ws):.0f}")
