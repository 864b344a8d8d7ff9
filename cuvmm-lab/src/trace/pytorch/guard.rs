//! A pass over a pickle's opcodes before serde-pickle decodes it, refusing what would make decoding
//! exhaust memory, time or the stack.
//!
//! serde-pickle builds the whole pickle as a tree of values and then walks it recursively, so three kinds
//! of small files would crash or stall it (found reading serde-pickle while writing the `pytorch_snapshot`
//! fuzz target, and confirmed: an 84-byte file that doubles a list forty times with `DUP` aborted cuvmm out
//! of memory, and a 3 MB list nested a million deep overflowed its stack):
//! - opcodes that copy a value: `DUP`, storing a memo reference in the memo again, and object construction
//!   (`GLOBAL`/`REDUCE`/...), whose arguments serde-pickle copies out of the memo;
//! - nesting deep enough to overflow the stack in serde's recursive walk (and in dropping the tree);
//! - sharing: each reference to a memoized value is walked in full, so a value referenced a million times
//!   is walked a million times.
//!
//! A memory snapshot is dictionaries, lists, tuples, strings and numbers written by Python's pickler, which
//! never copies, never references a container before it is complete (no snapshot is recursive) and nests
//! about seven levels deep. The pass models each value by its size (nodes outside memoized values) and its
//! depth, and refuses a copying opcode, a change to a container that was already referenced, nesting deeper
//! than [`MAX_DEPTH`], and more than [`visit_budget`] nodes walked in all. Where it cannot read on (a
//! truncated file, an unknown opcode, a stack underflow), it stops and leaves the error to serde-pickle,
//! which fails at the same byte.

use std::collections::HashMap;

/// The deepest nesting accepted. A snapshot nests about seven levels; serde's recursive walk is safe far
/// beyond this, even on a test thread's 2 MiB stack in a debug build.
pub const MAX_DEPTH: u32 = 100;

/// The most value nodes serde-pickle may walk for a file of `len` bytes: 64 per byte, and at least 2^24.
/// The shared snapshots (`../shared/traces`) need at most 2.8 per byte and nest 7 levels deep
/// (`cargo test --test trace_formats shared_snapshots -- --nocapture`).
pub fn visit_budget(len: usize) -> u64 {
    (len as u64).saturating_mul(64).max(1 << 24)
}

/// What decoding a pickle that passed costs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    /// How deep the decoded value nests (0 for a scalar).
    pub depth: u32,
    /// Value nodes serde-pickle walks: each memoized value once per reference.
    pub walked: u64,
    /// Whether the pass reached the pickle's end (`STOP`); if not, serde-pickle refuses the file where
    /// the pass stopped, and the cost is that of the part before.
    pub complete: bool,
}

/// Why a pickle is refused, and at which byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Offset of the opcode.
    pub offset: usize,
    /// What it would do.
    pub what: &'static str,
}

#[derive(Clone, Copy, Debug)]
enum Item {
    /// A value on the stack: its nodes (memoized values inside count one each) and its depth.
    Value { size: u64, depth: u32 },
    /// A reference to a memoized value.
    Ref(u32),
}

#[derive(Clone, Copy, Debug)]
struct Memo {
    size: u64,
    depth: u32,
    /// References pushed by `GET`s: each is one more full walk of the value.
    gets: u64,
}

/// The pickle machine, with values reduced to their size and depth.
#[derive(Default)]
struct Machine {
    stack: Vec<Item>,
    marks: Vec<Vec<Item>>,
    memo: HashMap<u32, Memo>,
}

/// Checks the pickle in `bytes` and says what decoding it costs.
///
/// # Errors
/// A [`Refusal`] naming the first opcode that would copy, nest too deep or exceed the budget.
pub fn check(bytes: &[u8]) -> Result<Cost, Refusal> {
    let mut machine = Machine::default();
    let mut at = 0;
    while let Some(&op) = bytes.get(at) {
        let refuse = |what| Refusal { offset: at, what };
        let Some(arg_len) = argument_length(op, &bytes[at + 1..]) else {
            break;
        };
        let arg = &bytes[at + 1..at + 1 + arg_len];
        match machine.step(op, arg) {
            Step::Next => {}
            Step::Stop if machine.walked() > visit_budget(bytes.len()) => {
                return Err(refuse(
                    "shared values that would be walked more than 64 times per byte of the file",
                ));
            }
            Step::Stop => return Ok(machine.cost(true)),
            Step::Unknown => break,
            Step::Refuse(what) => return Err(refuse(what)),
        }
        at += 1 + arg_len;
    }
    Ok(machine.cost(false))
}

/// The length of the argument of `op` at the start of `rest`, or `None` if `op` is unknown or the
/// argument is cut short.
fn argument_length(op: u8, rest: &[u8]) -> Option<usize> {
    let counted = |width: usize| -> Option<usize> {
        let field = rest.get(..width)?;
        let mut le = [0u8; 8];
        le[..width].copy_from_slice(field);
        let n = usize::try_from(u64::from_le_bytes(le)).ok()?;
        // A negative 4-byte count (LONG4, BINSTRING) is refused by serde-pickle too.
        if width == 4 && field[3] & 0x80 != 0 && matches!(op, b'\x8b' | b'T') {
            return None;
        }
        let total = width.checked_add(n)?;
        (total <= rest.len()).then_some(total)
    };
    let fixed = |n: usize| (n <= rest.len()).then_some(n);
    match op {
        // No argument.
        b'.' | b'(' | b'0' | b'1' | b'2' | b'\x94' | b'N' | b'\x88' | b'\x89' | b')' | b'\x85'
        | b'\x86' | b'\x87' | b't' | b']' | b'l' | b'a' | b'e' | b'}' | b'd' | b's' | b'u'
        | b'\x8f' | b'\x90' | b'\x91' | b'\x93' | b'R' | b'o' | b'b' | b'\x81' | b'\x92' => Some(0),
        // Fixed widths: PROTO, BINPUT, BINGET, BININT1; BININT2; BININT, LONG_BINPUT, LONG_BINGET;
        // BINFLOAT, FRAME.
        b'\x80' | b'q' | b'h' | b'K' => fixed(1),
        b'M' => fixed(2),
        b'J' | b'r' | b'j' => fixed(4),
        b'G' | b'\x95' => fixed(8),
        // Counted: LONG1, SHORT_BINBYTES, SHORT_BINSTRING, SHORT_BINUNICODE; LONG4, BINBYTES,
        // BINSTRING, BINUNICODE; BINUNICODE8, BINBYTES8, BYTEARRAY8.
        b'\x8a' | b'C' | b'U' | b'\x8c' => counted(1),
        b'\x8b' | b'B' | b'T' | b'X' => counted(4),
        b'\x8d' | b'\x8e' | b'\x96' => counted(8),
        // A line: INT, LONG, FLOAT, STRING, UNICODE, PUT, GET; GLOBAL and INST take two.
        b'I' | b'L' | b'F' | b'S' | b'V' | b'p' | b'g' => {
            Some(rest.iter().position(|&b| b == b'\n')? + 1)
        }
        b'c' | b'i' => {
            let first = rest.iter().position(|&b| b == b'\n')? + 1;
            Some(first + rest[first..].iter().position(|&b| b == b'\n')? + 1)
        }
        _ => None,
    }
}

enum Step {
    Next,
    Stop,
    Unknown,
    Refuse(&'static str),
}

const SCALAR: Item = Item::Value { size: 1, depth: 0 };

impl Machine {
    fn step(&mut self, op: u8, arg: &[u8]) -> Step {
        match self.apply(op, arg) {
            Ok(step) => step,
            Err(step) => step,
        }
    }

    /// One opcode. `Err` carries a step that ends the pass (underflow, refusal).
    fn apply(&mut self, op: u8, arg: &[u8]) -> Result<Step, Step> {
        match op {
            // The result stays on the stack, so that the budget counts it.
            b'.' => return Ok(Step::Stop),
            b'\x80' | b'\x95' => {}
            b'(' => self.marks.push(std::mem::take(&mut self.stack)),
            b'0' => {
                if self.stack.pop().is_none() {
                    self.pop_mark()?;
                }
            }
            b'1' => drop(self.pop_mark()?),
            b'2' => return Err(Step::Refuse("DUP copies a value")),
            b'c' | b'\x93' | b'R' | b'i' | b'o' | b'b' | b'\x81' | b'\x92' => {
                return Err(Step::Refuse(
                    "object construction (GLOBAL, REDUCE, ...), which a memory snapshot never holds",
                ));
            }
            b'p' | b'q' | b'r' | b'\x94' => {
                let id = match op {
                    b'p' => ascii_id(arg)?,
                    b'q' => u32::from(arg[0]),
                    b'r' => u32::from_le_bytes([arg[0], arg[1], arg[2], arg[3]]),
                    _ => self.memo.len() as u32,
                };
                self.memoize(id)?;
            }
            b'g' | b'h' | b'j' => {
                let id = match op {
                    b'g' => ascii_id(arg)?,
                    b'h' => u32::from(arg[0]),
                    _ => u32::from_le_bytes([arg[0], arg[1], arg[2], arg[3]]),
                };
                let memo = self.memo.get_mut(&id).ok_or(Step::Unknown)?;
                memo.gets += 1;
                self.stack.push(Item::Ref(id));
            }
            b')' | b']' | b'}' | b'\x8f' => self.stack.push(SCALAR),
            b'\x85' | b'\x86' | b'\x87' => {
                let n = usize::from(op - b'\x84');
                let split = self.stack.len().checked_sub(n).ok_or(Step::Unknown)?;
                let items = self.stack.split_off(split);
                let tuple = self.container(&items)?;
                self.stack.push(tuple);
            }
            b't' | b'l' | b'd' | b'\x91' => {
                let items = self.pop_mark()?;
                let built = self.container(&items)?;
                self.stack.push(built);
            }
            b'a' => {
                let item = self.pop()?;
                self.extend(&[item])?;
            }
            b's' => {
                let value = self.pop()?;
                let key = self.pop()?;
                self.extend(&[key, value])?;
            }
            b'e' | b'u' | b'\x90' => {
                let items = self.pop_mark()?;
                self.extend(&items)?;
            }
            // NONE, NEWTRUE, NEWFALSE, and the numbers, strings and bytes.
            b'N' | b'\x88' | b'\x89' | b'I' | b'L' | b'F' | b'S' | b'V' | b'G' | b'J' | b'K'
            | b'M' | b'\x8a' | b'\x8b' | b'C' | b'B' | b'\x8e' | b'\x96' | b'U' | b'T'
            | b'\x8c' | b'X' | b'\x8d' => self.stack.push(SCALAR),
            _ => return Err(Step::Unknown),
        }
        Ok(Step::Next)
    }

    fn pop(&mut self) -> Result<Item, Step> {
        self.stack.pop().ok_or(Step::Unknown)
    }

    fn pop_mark(&mut self) -> Result<Vec<Item>, Step> {
        let below = self.marks.pop().ok_or(Step::Unknown)?;
        Ok(std::mem::replace(&mut self.stack, below))
    }

    fn size_depth(&self, item: Item) -> (u64, u32) {
        match item {
            Item::Value { size, depth } => (size, depth),
            Item::Ref(id) => (1, self.memo.get(&id).map_or(0, |m| m.depth)),
        }
    }

    /// A new container of `items`.
    fn container(&self, items: &[Item]) -> Result<Item, Step> {
        let (mut size, mut depth) = (1u64, 0u32);
        for &item in items {
            let (s, d) = self.size_depth(item);
            size = size.saturating_add(s);
            depth = depth.max(d + 1);
        }
        if depth > MAX_DEPTH {
            return Err(Step::Refuse("nesting deeper than 100 levels"));
        }
        Ok(Item::Value { size, depth })
    }

    /// `items` added to the container on top of the stack.
    fn extend(&mut self, items: &[Item]) -> Result<(), Step> {
        let Item::Value { size, depth } = self.container(items)? else {
            unreachable!("container() builds values")
        };
        let (size, depth) = (size - 1, depth);
        let top = self.stack.last_mut().ok_or(Step::Unknown)?;
        let (target_size, target_depth) = match top {
            Item::Value { size, depth } => (size, depth),
            Item::Ref(id) => {
                let memo = self.memo.get_mut(id).ok_or(Step::Unknown)?;
                if memo.gets > 0 {
                    return Err(Step::Refuse("a container changed after it was referenced"));
                }
                (&mut memo.size, &mut memo.depth)
            }
        };
        *target_size = target_size.saturating_add(size);
        *target_depth = (*target_depth).max(depth);
        Ok(())
    }

    fn memoize(&mut self, id: u32) -> Result<(), Step> {
        let Item::Value { size, depth } = self.pop()? else {
            return Err(Step::Refuse("a memoized value stored again copies it"));
        };
        if self.memo.contains_key(&id) {
            return Err(Step::Refuse("a memo entry set twice"));
        }
        self.memo.insert(
            id,
            Memo {
                size,
                depth,
                gets: 0,
            },
        );
        self.stack.push(Item::Ref(id));
        Ok(())
    }

    /// The nodes walked in decoding the tree: each memoized value once per reference to it, the other
    /// nodes on the stack once.
    fn walked(&self) -> u64 {
        let memoized = self.memo.values().fold(0u64, |sum, m| {
            sum.saturating_add(m.size.saturating_mul(m.gets + 1))
        });
        let rest = self
            .stack
            .iter()
            .fold(0u64, |sum, &i| sum.saturating_add(self.size_depth(i).0));
        memoized.saturating_add(rest)
    }

    /// The cost so far; the depth is the result's (the stack's top).
    fn cost(&self, complete: bool) -> Cost {
        Cost {
            depth: self.stack.last().map_or(0, |&i| self.size_depth(i).1),
            walked: self.walked(),
            complete,
        }
    }
}

/// A memo id written in decimal (`PUT`, `GET`), without its line end.
fn ascii_id(arg: &[u8]) -> Result<u32, Step> {
    let text = std::str::from_utf8(arg).map_err(|_| Step::Unknown)?;
    text.trim_end_matches(['\n', '\r'])
        .parse()
        .map_err(|_| Step::Unknown)
}
