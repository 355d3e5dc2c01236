//! Where a sweep's calls come from: the points of a grid (its product, in
//! index order) or the lines of `--input`, each one call's kwargs.

use super::grid;
use super::kwargs::Kwargs;

/// The sweep's points, by index: a grid's product, or `--input`'s lines.
pub enum Points {
    Grid(grid::Grid),
    Lines(Vec<Kwargs>),
}

impl Points {
    pub fn len(&self) -> usize {
        match self {
            Points::Grid(grid) => grid.len(),
            Points::Lines(lines) => lines.len(),
        }
    }

    pub fn get(&self, index: usize) -> Kwargs {
        match self {
            Points::Grid(grid) => grid.point(index),
            Points::Lines(lines) => lines[index].clone(),
        }
    }
}
