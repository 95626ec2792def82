//! MinAtar Breakout, step for step identical to the Python package.
//!
//! MinAtar (Young and Tian, 2019, "MinAtar: An Atari-Inspired Testbed for Thorough and
//! Reproducible Reinforcement Learning Experiments") is a set of 10x10 miniature Atari games;
//! this module is its Breakout, written from the rules of the `minatar` package on PyPI,
//! version 1.0.15 ([`MINATAR_VERSION`]; `minatar/environment.py` and
//! `minatar/environments/breakout.py`), and checked against it by `tests/minatar_replay.rs`:
//! trajectories recorded from the package by `scripts/record_minatar.py` replay here with the
//! same states, rewards and terminals at every step, and with the same random draws.
//!
//! [`Breakout`] is `Environment('breakout')` with its defaults: the wrapper's sticky actions
//! (probability 0.1 of repeating the previous action) included; `difficulty_ramping=True` has no
//! effect in Breakout (the package's Breakout ignores it: the ball's speed never changes), so
//! there is no such option here.
//!
//! # The game
//!
//! A paddle on the bottom row, a ball that moves one cell diagonally per step, and three rows of
//! bricks (rows 1 to 3). Each step: the paddle moves (left or right, clamped to the grid); the
//! ball moves; a ball leaving the grid sideways stays in the edge column and its horizontal
//! direction flips; leaving at the top it stays in row 0 and its vertical direction flips;
//! entering a brick breaks it (reward +1), the ball stays in its row and its vertical direction
//! flips, except on the step right after a brick was broken, when the ball enters the brick
//! without breaking it (a quirk of the package, kept); reaching the bottom row, the bricks come
//! back if none is left, then the ball bounces up if the paddle is under the ball's previous
//! column (vertical flip) or under its new column (both directions flip), and otherwise the
//! episode ends. Rewards are 0 or 1; there is no step limit.
//!
//! # Actions
//!
//! All MinAtar games have 6 actions ([`NUM_ACTIONS`]), indices into the package's action map
//! `['n', 'l', 'u', 'r', 'd', 'f']`: 0 no-op, 1 left, 2 up, 3 right, 4 down, 5 fire. In Breakout
//! only left and right do anything; up, down and fire act as the no-op.
//! [`MINIMAL_ACTION_SET`] is the package's `minimal_action_set()`: `[0, 1, 3]` (no-op, left,
//! right). Gymnasium's `MinAtar/Breakout-v0` uses the 6 actions, `-v1` the minimal set.
//!
//! # State
//!
//! [`Breakout::state`] is the package's `state()`: a 10x10x4 boolean image, row-major NHWC with
//! the channel fastest, index `(row * 10 + column) * 4 + channel` ([`state_index`]), row 0 at the
//! top, the channels in MinAtar's order: 0 paddle, 1 ball, 2 trail (the ball's previous cell,
//! which shows its direction), 3 brick ([`channel`]). [`Breakout::write_state`] writes it as
//! 0.0/1.0 into an `f32` buffer of the network's input layout `[10, 10, 4]`.
//!
//! # Randomness
//!
//! The environment draws random numbers at two points, in this order, from one generator (the
//! package's `numpy.random.RandomState`, shared by the wrapper and the game after `seed`):
//!
//! - every [`Breakout::act`] draws one `rand()` (a double in [0, 1)), also when the episode has
//!   already ended: if it is below the sticky-action probability, the previous action
//!   (initially 0, kept across resets) is taken instead of the one given;
//! - every reset draws one `randint(2)`: 0 starts the ball at row 3, column 0, moving down-right;
//!   1 at row 3, column 9, moving down-left.
//!
//! The draws come from a [`RandomSource`]. [`Mt19937`] is numpy's `RandomState` (the same
//! Mersenne Twister, seeding, `rand()` and `randint(n)` algorithms), so [`Breakout::new`]`(seed)`
//! is exactly `env = Environment('breakout'); env.seed(seed); env.reset()`: given the same
//! actions, the same episodes, draw for draw. The replay test implements [`RandomSource`] with
//! the draws recorded from Python instead.
//!
//! Stepping allocates nothing.

// Included by an example and by tests/minatar_replay.rs; not every item is used by each.
#![allow(dead_code)]

/// The version of the `minatar` package this module reproduces and is tested against.
pub const MINATAR_VERSION: &str = "1.0.15";

/// Rows of the grid.
pub const HEIGHT: usize = 10;
/// Columns of the grid.
pub const WIDTH: usize = 10;
/// Channels of the state: paddle, ball, trail, brick.
pub const CHANNELS: usize = 4;
/// Length of a state: `HEIGHT * WIDTH * CHANNELS`.
pub const STATE_LEN: usize = HEIGHT * WIDTH * CHANNELS;
/// The number of actions of every MinAtar game.
pub const NUM_ACTIONS: usize = 6;
/// The package's `minimal_action_set()` for Breakout: no-op, left, right.
pub const MINIMAL_ACTION_SET: [usize; 3] = [action::NOOP, action::LEFT, action::RIGHT];
/// `Environment`'s default `sticky_action_prob`.
pub const DEFAULT_STICKY_ACTION_PROB: f64 = 0.1;

/// The actions, in the package's order (`['n', 'l', 'u', 'r', 'd', 'f']`).
pub mod action {
    pub const NOOP: usize = 0;
    pub const LEFT: usize = 1;
    pub const UP: usize = 2;
    pub const RIGHT: usize = 3;
    pub const DOWN: usize = 4;
    pub const FIRE: usize = 5;
}

/// The state's channels, in MinAtar's order.
pub mod channel {
    pub const PADDLE: usize = 0;
    pub const BALL: usize = 1;
    pub const TRAIL: usize = 2;
    pub const BRICK: usize = 3;
}

/// Index of (row, column, channel) in a state.
#[inline]
pub const fn state_index(row: usize, col: usize, ch: usize) -> usize {
    (row * WIDTH + col) * CHANNELS + ch
}

/// Where the environment's random numbers come from: the two `numpy.random.RandomState`
/// methods the package calls.
pub trait RandomSource {
    /// `RandomState.rand()`: a double in [0, 1).
    fn rand(&mut self) -> f64;
    /// `RandomState.randint(n)`: an integer in [0, n), `n >= 1`.
    fn randint(&mut self, n: u32) -> u32;
}

/// numpy's legacy `RandomState`: MT19937 seeded as `RandomState(seed)` with an integer seed,
/// `rand()` (53 bits from two outputs) and `randint(n)` (one output masked to the next power of
/// two minus one, rejected until below `n`; no output for `n == 1`), so it yields the same
/// numbers as numpy for the same seed and calls.
#[derive(Clone)]
pub struct Mt19937 {
    mt: [u32; 624],
    index: usize,
}

impl Mt19937 {
    /// `numpy.random.RandomState(seed)`.
    pub fn new(seed: u32) -> Self {
        let mut mt = [0u32; 624];
        mt[0] = seed;
        for i in 1..624 {
            mt[i] = 1812433253u32
                .wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 30))
                .wrapping_add(i as u32);
        }
        Mt19937 { mt, index: 624 }
    }

    fn twist(&mut self) {
        for k in 0..624 {
            let y = (self.mt[k] & 0x8000_0000) | (self.mt[(k + 1) % 624] & 0x7fff_ffff);
            let mag = if y & 1 != 0 { 0x9908_b0df } else { 0 };
            self.mt[k] = self.mt[(k + 397) % 624] ^ (y >> 1) ^ mag;
        }
        self.index = 0;
    }

    /// The next 32-bit output.
    #[inline]
    pub fn next_u32(&mut self) -> u32 {
        if self.index >= 624 {
            self.twist();
        }
        let mut y = self.mt[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }
}

impl RandomSource for Mt19937 {
    #[inline]
    fn rand(&mut self) -> f64 {
        let a = (self.next_u32() >> 5) as f64;
        let b = (self.next_u32() >> 6) as f64;
        (a * 67108864.0 + b) / 9007199254740992.0
    }

    #[inline]
    fn randint(&mut self, n: u32) -> u32 {
        assert!(n >= 1, "randint({n}): empty range");
        let max = n - 1;
        if max == 0 {
            return 0;
        }
        let mask = u32::MAX >> max.leading_zeros();
        loop {
            let v = self.next_u32() & mask;
            if v <= max {
                return v;
            }
        }
    }
}

/// Bricks as bits `row * 10 + column`.
const BRICK_ROWS: u128 = ((1u128 << 30) - 1) << 10; // rows 1, 2, 3

/// MinAtar's Breakout with the `Environment` wrapper's sticky actions. See the module docs.
#[derive(Clone)]
pub struct Breakout<R: RandomSource = Mt19937> {
    rng: R,
    sticky_action_prob: f64,
    last_action: usize,
    ball_x: i32,
    ball_y: i32,
    /// 0 up-left, 1 up-right, 2 down-right, 3 down-left (the package's `ball_dir`).
    ball_dir: usize,
    pos: i32,
    last_x: i32,
    last_y: i32,
    bricks: u128,
    strike: bool,
    terminal: bool,
}

impl Breakout<Mt19937> {
    /// `env = Environment('breakout'); env.seed(seed); env.reset()`: the default sticky-action
    /// probability 0.1 and numpy's generator seeded with `seed`; the first episode has started
    /// (its reset has drawn), so call [`act`](Self::act) next, not [`reset`](Self::reset).
    pub fn new(seed: u32) -> Self {
        Self::with_source(Mt19937::new(seed), DEFAULT_STICKY_ACTION_PROB)
    }
}

impl<R: RandomSource> Breakout<R> {
    /// An environment drawing from `rng` with the given sticky-action probability
    /// (`Environment('breakout', sticky_action_prob=p)`); it resets at once (one `randint(2)`).
    pub fn with_source(rng: R, sticky_action_prob: f64) -> Self {
        let mut env = Breakout {
            rng,
            sticky_action_prob,
            last_action: action::NOOP,
            ball_x: 0,
            ball_y: 0,
            ball_dir: 0,
            pos: 0,
            last_x: 0,
            last_y: 0,
            bricks: 0,
            strike: false,
            terminal: false,
        };
        env.reset();
        env
    }

    /// Starts a new episode (`env.reset()`): one `randint(2)` for the ball's side. The previous
    /// action, which sticky actions repeat, is kept, as in the package.
    pub fn reset(&mut self) {
        self.ball_y = 3;
        let (x, dir) = if self.rng.randint(2) == 0 {
            (0, 2)
        } else {
            (9, 3)
        };
        self.ball_x = x;
        self.ball_dir = dir;
        self.pos = 4;
        self.bricks = BRICK_ROWS;
        self.strike = false;
        self.last_x = self.ball_x;
        self.last_y = self.ball_y;
        self.terminal = false;
    }

    /// One step (`env.act(action)`), `action` in `0..6`: returns (reward, terminal). Draws one
    /// `rand()` for the sticky action first, also after the episode has ended, when it returns
    /// (0, true) and changes nothing but the remembered action.
    pub fn act(&mut self, action: usize) -> (f32, bool) {
        assert!(
            action < NUM_ACTIONS,
            "action {action} out of 0..{NUM_ACTIONS}"
        );
        let a = if self.rng.rand() < self.sticky_action_prob {
            self.last_action
        } else {
            action
        };
        self.last_action = a;
        self.step(a)
    }

    /// The game's `act` (breakout.py), after the sticky action.
    fn step(&mut self, a: usize) -> (f32, bool) {
        if self.terminal {
            return (0.0, true);
        }
        let mut r = 0.0;
        match a {
            action::LEFT => self.pos = (self.pos - 1).max(0),
            action::RIGHT => self.pos = (self.pos + 1).min(9),
            _ => {}
        }

        self.last_x = self.ball_x;
        self.last_y = self.ball_y;
        let (dx, dy) = [(-1, -1), (1, -1), (1, 1), (-1, 1)][self.ball_dir];
        let mut new_x = self.ball_x + dx;
        let mut new_y = self.ball_y + dy;

        let mut strike_toggle = false;
        if !(0..=9).contains(&new_x) {
            new_x = new_x.clamp(0, 9);
            self.ball_dir = [1, 0, 3, 2][self.ball_dir];
        }
        if new_y < 0 {
            new_y = 0;
            self.ball_dir = [3, 2, 1, 0][self.ball_dir];
        } else if self.bricks & brick_bit(new_y, new_x) != 0 {
            strike_toggle = true;
            if !self.strike {
                r += 1.0;
                self.strike = true;
                self.bricks &= !brick_bit(new_y, new_x);
                new_y = self.last_y;
                self.ball_dir = [3, 2, 1, 0][self.ball_dir];
            }
        } else if new_y == 9 {
            if self.bricks == 0 {
                self.bricks = BRICK_ROWS;
            }
            if self.ball_x == self.pos {
                self.ball_dir = [3, 2, 1, 0][self.ball_dir];
                new_y = self.last_y;
            } else if new_x == self.pos {
                self.ball_dir = [2, 3, 0, 1][self.ball_dir];
                new_y = self.last_y;
            } else {
                self.terminal = true;
            }
        }

        if !strike_toggle {
            self.strike = false;
        }
        self.ball_x = new_x;
        self.ball_y = new_y;
        (r, self.terminal)
    }

    /// The state (`env.state()`), NHWC `[10, 10, 4]`, channels paddle, ball, trail, brick.
    pub fn state(&self) -> [bool; STATE_LEN] {
        let mut s = [false; STATE_LEN];
        self.for_each_active(|i| s[i] = true);
        s
    }

    /// The state as 0.0 / 1.0 into `out` (length [`STATE_LEN`], the network's NHWC input).
    pub fn write_state(&self, out: &mut [f32]) {
        assert_eq!(
            out.len(),
            STATE_LEN,
            "a Breakout state has {STATE_LEN} values"
        );
        out.fill(0.0);
        self.for_each_active(|i| out[i] = 1.0);
    }

    fn for_each_active(&self, mut set: impl FnMut(usize)) {
        let cell = |y: i32, x: i32| (y as usize) * WIDTH + x as usize;
        set(cell(self.ball_y, self.ball_x) * CHANNELS + channel::BALL);
        set(cell(9, self.pos) * CHANNELS + channel::PADDLE);
        set(cell(self.last_y, self.last_x) * CHANNELS + channel::TRAIL);
        let mut b = self.bricks;
        while b != 0 {
            let i = b.trailing_zeros() as usize;
            set(i * CHANNELS + channel::BRICK);
            b &= b - 1;
        }
    }

    /// `num_actions()`: 6, as every MinAtar game.
    pub fn num_actions(&self) -> usize {
        NUM_ACTIONS
    }

    /// `minimal_action_set()`: `[0, 1, 3]`.
    pub fn minimal_action_set(&self) -> [usize; 3] {
        MINIMAL_ACTION_SET
    }

    /// `state_shape()`: `[10, 10, 4]`.
    pub fn state_shape(&self) -> [usize; 3] {
        [HEIGHT, WIDTH, CHANNELS]
    }

    /// Whether the episode has ended (the ball reached the bottom row past the paddle).
    pub fn is_terminal(&self) -> bool {
        self.terminal
    }

    /// The action taken by the last [`act`](Self::act) (after the sticky-action choice).
    pub fn last_action(&self) -> usize {
        self.last_action
    }

    /// The sticky-action probability.
    pub fn sticky_action_prob(&self) -> f64 {
        self.sticky_action_prob
    }

    /// The random source.
    pub fn source(&self) -> &R {
        &self.rng
    }

    /// The random source, e.g. to feed a replay source the next recorded draws.
    pub fn source_mut(&mut self) -> &mut R {
        &mut self.rng
    }
}

#[inline]
fn brick_bit(y: i32, x: i32) -> u128 {
    1u128 << (y as usize * WIDTH + x as usize)
}
