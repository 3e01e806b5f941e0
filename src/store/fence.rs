//! The typed expressions a fenced batch write needs and Diesel's query builder lacks.
//!
//! A fenced write changes a row only at the `lease_version` its claim set, for a whole batch in
//! one statement: `UPDATE ... FROM unnest(...)` and row-value `IN` have no place in the DSL,
//! so [`Fenced`] is the filter "this row at this version" for a batch, and [`PerRow`] is a
//! value that differs from row to row of the batch (a dead row's error, a reschedule's delay).
//! With them a write reads
//!
//! ```text
//! diesel::update(outbox::table)
//!     .filter(held())
//!     .filter(batch.fenced())
//!     .set((
//!         outbox::status.eq(Status::Dead),
//!         outbox::last_error.eq(batch.per_row::<Text, _>(&errors).nullable()),
//!         ...
//!     ))
//! ```
//!
//! and every column it names, here too, goes through [`crate::schema::outbox`]: renaming or
//! retyping a column in the schema breaks the build of these writes, not their first run. The
//! text these expressions add is keywords, operators and the functions `unnest` and
//! `width_bucket`; it depends only on their types, never on the batch (each array is one bind),
//! so a write is one prepared statement whatever its batch size.

use std::marker::PhantomData;

use diesel::expression::{AppearsOnTable, Expression, SelectableExpression, TypedExpressionType, ValidGrouping};
use diesel::pg::Pg;
use diesel::query_builder::{AstPass, QueryFragment, QueryId};
use diesel::serialize::ToSql;
use diesel::sql_types::{Array, Bool, HasSqlType, Int8, SqlType};
use diesel::{ExpressionMethods, QueryResult};

use crate::model::{Fence, Status};
use crate::schema::outbox;

/// The filter every fenced batch write carries beside [`Batch::fenced`]: the row is still
/// `processing`, so a row that was reaped or finalized already is not written again, even at
/// its version. The batch's rows are found by primary key ([`Batch::fenced`]); no index reads
/// `status`.
pub(crate) fn held() -> diesel::dsl::Eq<outbox::status, Status> {
    outbox::status.eq(Status::Processing)
}

/// The rows of one fenced write, sorted by id, one claim per row: the binds of [`Fenced`] and
/// of every [`PerRow`] value.
///
/// Of two claims of the same row in `rows`, only the later (higher `lease_version`) can still
/// be current, so the batch keeps that one; a write therefore never sees an id twice, which
/// [`PerRow`] relies on.
pub(crate) struct Batch<'r, T> {
    rows: Vec<&'r T>,
    ids: Vec<i64>,
    versions: Vec<i64>,
}

impl<'r, T> Batch<'r, T> {
    /// The batch of `rows`, each claimed by `fence(row)`.
    pub(crate) fn new(rows: &'r [T], fence: impl Fn(&T) -> Fence) -> Self {
        let mut claimed: Vec<(Fence, &'r T)> = rows.iter().map(|r| (fence(r), r)).collect();
        claimed.sort_unstable_by_key(|(f, _)| (f.id, std::cmp::Reverse(f.lease_version)));
        claimed.dedup_by_key(|(f, _)| f.id);
        let ids = claimed.iter().map(|(f, _)| f.id).collect();
        let versions = claimed.iter().map(|(f, _)| f.lease_version).collect();
        Batch { rows: claimed.into_iter().map(|(_, r)| r).collect(), ids, versions }
    }

    /// The rows in batch order: the order of the values given to [`Batch::per_row`].
    pub(crate) fn rows(&self) -> impl Iterator<Item = &'r T> + '_ {
        self.rows.iter().copied()
    }

    /// The filter "each row at its claim's version".
    pub(crate) fn fenced(&self) -> Fenced<'_> {
        Fenced { ids: &self.ids, version: self.per_row(&self.versions) }
    }

    /// The value of `values` that belongs to the row being written: `values[i]` for the `i`-th
    /// row of [`Batch::rows`], as SQL type `ST`. Only meaningful on rows the write's
    /// [`Batch::fenced`] admits.
    pub(crate) fn per_row<'a, ST, V>(&'a self, values: &'a [V]) -> PerRow<'a, ST, V> {
        PerRow { ids: &self.ids, values, sql_type: PhantomData }
    }
}

/// `outbox.id = ANY($ids) AND outbox.lease_version = ($versions)[width_bucket(outbox.id,
/// $ids)]`: the row is one of the batch, at its claim's version.
///
/// The primary key finds the batch's rows, one probe each, and each row's version is then
/// checked against its own claim's, found in the sorted ids by binary search (as
/// [`PerRow`] finds a row's value): no join at all. Two forms before this one cost more. The
/// row-value `IN (SELECT * FROM unnest($ids, $versions))` alone, and the `UPDATE ... FROM
/// unnest(...)` before it, made the planner join the batch to every `processing` row, at a cost
/// that grows with the rows in flight. Both halves together still hash-joined the batch to the
/// rows found.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Fenced<'a> {
    ids: &'a [i64],
    /// Each row's claim's version.
    version: PerRow<'a, Int8, i64>,
}

impl Expression for Fenced<'_> {
    type SqlType = Bool;
}

impl QueryFragment<Pg> for Fenced<'_> {
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        out.push_sql("(");
        outbox::id.walk_ast(out.reborrow())?;
        out.push_sql(" = ANY(");
        out.push_bind_param::<Array<Int8>, [i64]>(self.ids)?;
        out.push_sql(") AND ");
        outbox::lease_version.walk_ast(out.reborrow())?;
        out.push_sql(" = ");
        self.version.walk_ast(out.reborrow())?;
        out.push_sql(")");
        Ok(())
    }
}

/// The text is fixed (two array binds, whatever their length): one type, one statement.
impl QueryId for Fenced<'_> {
    type QueryId = Fenced<'static>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<QS> AppearsOnTable<QS> for Fenced<'_>
where
    outbox::id: AppearsOnTable<QS>,
    outbox::lease_version: AppearsOnTable<QS>,
{
}

impl<QS> SelectableExpression<QS> for Fenced<'_>
where
    outbox::id: SelectableExpression<QS>,
    outbox::lease_version: SelectableExpression<QS>,
{
}

/// Per row, like a column.
impl ValidGrouping<()> for Fenced<'_> {
    type IsAggregate = diesel::expression::is_aggregate::No;
}

/// `($values)[width_bucket(outbox.id, $ids)]`: the value of the batch's row being written.
///
/// `width_bucket` finds `outbox.id` in the sorted ids by binary search, and an id of the batch
/// is its own bucket, so the subscript is the row's position in the batch (the ids are sorted
/// and unique: see [`Batch`]). A correlated `(SELECT v.x FROM unnest($ids, $values) AS v(id, x)
/// WHERE v.id = outbox.id)` reads the same value, but scans the whole batch for each written
/// row: for `mark_dead` of 500 rows, a subplan of 500 loops × 500 rows that alone took 16 ms,
/// where the whole write with this lookup takes 4 to 5 ms.
///
/// On a row outside the batch (none passes [`Fenced`]) it is `NULL` or another row's value.
#[derive(Debug)]
pub(crate) struct PerRow<'a, ST, V> {
    ids: &'a [i64],
    values: &'a [V],
    sql_type: PhantomData<fn() -> ST>,
}

impl<ST, V> Clone for PerRow<'_, ST, V> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<ST, V> Copy for PerRow<'_, ST, V> {}

impl<ST, V> Expression for PerRow<'_, ST, V>
where
    ST: SqlType + TypedExpressionType,
{
    type SqlType = ST;
}

impl<ST, V> QueryFragment<Pg> for PerRow<'_, ST, V>
where
    ST: 'static,
    Pg: HasSqlType<ST>,
    V: ToSql<ST, Pg>,
{
    fn walk_ast<'b>(&'b self, mut out: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        if self.values.len() != self.ids.len() {
            return Err(diesel::result::Error::QueryBuilderError(
                format!("{} per-row values for a batch of {} rows", self.values.len(), self.ids.len()).into(),
            ));
        }
        out.push_sql("(");
        out.push_bind_param::<Array<ST>, [V]>(self.values)?;
        out.push_sql(")[width_bucket(");
        outbox::id.walk_ast(out.reborrow())?;
        out.push_sql(", ");
        out.push_bind_param::<Array<Int8>, [i64]>(self.ids)?;
        out.push_sql(")]");
        Ok(())
    }
}

/// The text is fixed; the bind types are `ST[]` and `int8[]`, so the id names `ST` (not the
/// Rust type of the values, which does not change the statement).
impl<ST: 'static, V> QueryId for PerRow<'_, ST, V> {
    type QueryId = PerRow<'static, ST, ()>;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<ST, V, QS> AppearsOnTable<QS> for PerRow<'_, ST, V>
where
    Self: Expression,
    outbox::id: AppearsOnTable<QS>,
{
}

impl<ST, V, QS> SelectableExpression<QS> for PerRow<'_, ST, V>
where
    Self: Expression,
    outbox::id: SelectableExpression<QS>,
{
}

/// Per row, like a column.
impl<ST, V> ValidGrouping<()> for PerRow<'_, ST, V> {
    type IsAggregate = diesel::expression::is_aggregate::No;
}

#[cfg(test)]
mod tests {
    use diesel::sql_types::Text;
    use diesel::{NullableExpressionMethods, debug_query};

    use super::*;

    fn fence(id: i64, lease_version: i64) -> Fence {
        Fence { id, lease_version }
    }

    #[test]
    fn a_batch_is_sorted_with_one_claim_per_row_the_latest() {
        let rows = [fence(9, 1), fence(3, 2), fence(9, 4), fence(5, 1), fence(3, 2)];
        let batch = Batch::new(&rows, |f| *f);
        assert_eq!(batch.ids, [3, 5, 9]);
        assert_eq!(batch.versions, [2, 1, 4]);
        assert_eq!(batch.rows().copied().collect::<Vec<_>>(), [fence(3, 2), fence(5, 1), fence(9, 4)]);
    }

    #[test]
    fn the_text_does_not_depend_on_the_batch() {
        let sql = |n: i64| {
            let rows: Vec<Fence> = (1..=n).map(|id| fence(id, 1)).collect();
            let batch = Batch::new(&rows, |f| *f);
            let errors: Vec<String> = batch.rows().map(|f| format!("e{}", f.id)).collect();
            let query = diesel::update(outbox::table)
                .filter(held())
                .filter(batch.fenced())
                .set(outbox::last_error.eq(batch.per_row::<Text, _>(&errors).nullable()))
                .returning(outbox::id);
            let text = debug_query::<Pg, _>(&query).to_string();
            text[..text.find(" -- binds").unwrap()].to_owned()
        };
        assert_eq!(sql(1), sql(500));
        assert_eq!(
            sql(1),
            r#"UPDATE "outbox" SET "last_error" = ($1)[width_bucket("outbox"."id", $2)] WHERE (("outbox"."status" = $3) AND ("outbox"."id" = ANY($4) AND "outbox"."lease_version" = ($5)[width_bucket("outbox"."id", $6)])) RETURNING "outbox"."id""#
        );
    }

    #[test]
    fn mismatched_per_row_values_are_refused() {
        let rows = [fence(1, 1), fence(2, 1)];
        let batch = Batch::new(&rows, |f| *f);
        let one = ["x".to_owned()];
        let query = diesel::update(outbox::table)
            .filter(batch.fenced())
            .set(outbox::last_error.eq(batch.per_row::<Text, _>(&one).nullable()));
        let mut sql = diesel::pg::PgQueryBuilder::default();
        assert!(matches!(query.to_sql(&mut sql, &Pg), Err(diesel::result::Error::QueryBuilderError(_))));
    }

    #[test]
    fn a_select_with_the_fence_has_a_static_query_id() {
        use diesel::QueryDsl;
        let rows = [fence(1, 1)];
        let batch = Batch::new(&rows, |f| *f);
        fn query_id<Q: QueryId>(_: &Q) -> Option<std::any::TypeId> {
            Q::query_id()
        }
        let query = outbox::table.filter(batch.fenced()).select(outbox::id);
        assert!(query_id(&query).is_some(), "cached by type, without building its text first");
    }
}
