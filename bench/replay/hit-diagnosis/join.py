# Joins a PDX_EXP_PLOG file (pdx's picks: time, its tokens, pick, band, then each candidate's
# cached tokens, queue ahead/waiting and forecast) with a PDX_EXP_DUMP file of the same replay
# (switches.diff; that build's dump lines carry the arrival time too): each arrival takes the
# unmatched pick of the 30 ms before it whose tokens are nearest 1.093 of the engine's, and it
# prints what pdx thought of each prefill that left the TTFT-best engine holding more of it.
# Usage: python3 join.py PLOG DUMP
import sys, collections, statistics as st
picks=[]
for line in open(sys.argv[1]):
    v=line.split(); t=int(v[0]); tok=int(v[1]); pick=int(v[2]); band=float(v[3])
    cs=[(int(v[4+4*i]),int(v[5+4*i]),int(v[6+4*i]),float(v[7+4*i])) for i in range((len(v)-4)//4)]
    picks.append([t,tok,pick,band,cs,False])
arr=[]
for line in open(sys.argv[2]):
    v=line.split(); wid,t,at,tok=int(v[0]),int(v[1]),int(v[2]),int(v[3])
    es=[(float(v[4+3*i]),float(v[5+3*i]),int(v[6+3*i])) for i in range((len(v)-4)//3)]
    arr.append((t,at,tok,es))
tie=12.8
# token ratio
matched=[]
import bisect
times=[p[0] for p in picks]
for t,at,tok,es in arr:
    lo=bisect.bisect_left(times,t-30_000_000); hi=bisect.bisect_right(times,t)
    cands=[p for p in picks[lo:hi] if not p[5]]
    if not cands: continue
    best=min(cands,key=lambda p: abs(p[1]/max(tok,1)-1.093))
    if abs(best[1]/max(tok,1)-1.093)>0.3: continue
    best[5]=True
    matched.append((best,(t,at,tok,es)))
print('matched',len(matched),'of',len(arr),'picks',len(picks))
m=collections.Counter((p[2],a[1]) for p,a in matched); print('pick->engine',m.most_common(6))
mp={}
for (k,e),n in m.most_common():
    if k not in mp and e not in mp.values(): mp[k]=e
inv={e:k for k,e in mp.items()}
print('ratio median',st.median(p[1]/max(a[2],1) for p,a in matched))
cnt=collections.Counter()
for p,(t,at,tok,es) in matched:
    ttft=[w+c for w,c,_ in es]; best=min(range(len(es)),key=lambda i:ttft[i])
    most=max(e[2] for e in es); holder=max(range(len(es)),key=lambda i:es[i][2])
    if not(es[at][2]<most and ttft[at]-ttft[best]>tie and best==holder): continue
    kh=inv[holder]; kc=p[2]
    ph=p[4][kh]; pc=p[4][kc]
    kind='pdx-knew' if ph[0]>pc[0] else 'pdx-unaware'
    cnt[kind]+=1
    print(f"{kind:12} tok {tok} pdxtok {p[1]} | truth holder cached {es[holder][2]} wait {es[holder][0]:.0f} ttft {ttft[holder]:.0f}; chosen cached {es[at][2]} wait {es[at][0]:.0f} ttft {ttft[at]:.0f} | pdx holder cached {ph[0]} q {ph[1]}/{ph[2]} f {ph[3]:.0f}; chosen cached {pc[0]} q {pc[1]}/{pc[2]} f {pc[3]:.0f}; band {p[3]:.0f}")
print(cnt)
print('pick x engine', sorted(m.items()))
