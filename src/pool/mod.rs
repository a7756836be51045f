//! Pieces every pool kind shares (the paged KV pool and the replay pools): the table of
//! sequence slots, batch ids, layer selection and tensor-view helpers.

mod batch;
mod slots;
mod views;

pub use batch::{read_host_i32, BatchIds};
pub use slots::SlotTable;
pub use views::{
    as_batch_3d, as_batch_4d, check_float, check_layer, layer_range, require_positive,
};
