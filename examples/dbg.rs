use cuvmm::trace::pytorch::{self, TraceOp};
use cuvmm::split::Split;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::Strategy;
use std::collections::HashMap;
fn main() {
    let path = std::env::args().nth(1).unwrap();
    let t = pytorch::load(std::path::Path::new(&path), None).unwrap();
    let mut sim = SimDriver::new(SimConfig::default().with_capacity(200 << 30));
    sim.plan_malloc_addresses(t.initial.iter().map(|s| (s.size, s.addr)));
    let mut m = Split::new(sim, t.config.clone()).unwrap();
    let mut addrs = HashMap::new();
    for seg in &t.initial { let b = m.adopt_segment(&seg.seed()).unwrap(); assert_eq!(b, seg.addr); for l in &seg.live { addrs.insert(seg.addr + l.offset, (b + l.offset, l.size, l.requested)); } }
    let mut shown = 0;
    for (i, op) in t.ops.iter().enumerate() {
        match *op {
            TraceOp::Alloc { addr, size, stream } => { let got = m.alloc(size, stream).unwrap(); if got != addr && shown < 5 { shown += 1;
                println!("op {i}: alloc {size} truth {addr:#x} model {got:#x}");
                let seg = t.initial.iter().find(|s| addr >= s.addr && addr < s.addr + s.size);
                println!("  truth seg {:?}", seg.map(|s| (format!("{:#x}", s.addr), s.size, s.live.iter().map(|b| (b.offset, b.size)).collect::<Vec<_>>())));
                let seg = t.initial.iter().find(|s| got >= s.addr && got < s.addr + s.size);
                println!("  model seg {:?}", seg.map(|s| (format!("{:#x}", s.addr), s.size, s.live.iter().map(|b| (b.offset, b.size)).collect::<Vec<_>>())));
            } addrs.insert(addr, (got, 0, size)); }
            TraceOp::Free { addr } => { if let Some((g, _, _)) = addrs.remove(&addr) { m.free(g).unwrap(); } else { println!("op {i}: unknown free {addr:#x}"); } }
            TraceOp::EmptyCache => m.empty_cache().unwrap(),
        }
    }
}
